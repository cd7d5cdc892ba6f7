"""/v1's part of the request pipeline (app/http/pipeline.py): a JSON document in, JSON out.

`decode` reads the sizes from the parsed JSON's list lengths, before the schema converts a
number, so that admission refuses at the same cost at any size. N and D need only
`vectors` to be a list of lists; the factor and outputs count when valid as sent (or left
out). Anything else is the schema's to refuse (422) in `convert`.
"""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from flask import Request, Response
from marshmallow import ValidationError

from ...core.admission import AnswerCost
from ...core.dtypes import DEFAULT_DTYPE, DTYPES, WIDEST
from ...core.errors import many_unknown, unknown_fields
from ...core.request import (DEFAULT_OUTPUTS, OUTPUTS, GradientRequest, Sizes, admissible_factor, default_factor,
                             ordered_outputs, request_sizes)
from ...core.run import Result
from ...extensions import services
from ...http.errors import wrong_content_type
from ...http.parsing import decode_document, is_json_mimetype, schema_error
from ...http.pipeline import Decoded
from .render import render_result
from .schemas import GradientRequestSchema, load_plain

SCHEMA = GradientRequestSchema()  # one instance: not rebuilt (deep-copied fields) per request
NOT_AN_OBJECT = "The body must be a JSON object with at least `vectors`."


@dataclass(frozen=True)
class V1Job:
    gradient: GradientRequest

    @property
    def logged_outputs(self) -> tuple[str, ...]:
        return self.gradient.outputs


def answer_cost(body_bytes: int, dtype: str) -> AnswerCost:
    """The document holds the head (accumulated, losses) as text, then one block's text at a
    time: each written once into orjson's buffer and once as the bytes handed on."""
    text = DTYPES.get(dtype, WIDEST).text_bytes
    return AnswerCost(body_bytes=body_bytes, block_per_number=2 * text, head_per_number=2 * text)


class V1:
    def accept(self, request: Request) -> None:
        mimetype = request.mimetype
        if mimetype and not is_json_mimetype(mimetype):  # no Content-Type at all: read as JSON
            raise wrong_content_type(mimetype)

    def decode(self, body: bytes, request: Request) -> Decoded:
        document = decode_document(body)
        unknown = many_unknown(document, SCHEMA.fields)
        if unknown:
            raise unknown_fields(unknown, SCHEMA.fields)
        sizes = document_sizes(document)
        return Decoded(sizes, answer_cost(len(body), sizes.dtype if sizes else DEFAULT_DTYPE), document)

    def convert(self, decoded: Decoded) -> V1Job:
        plain = load_plain(decoded.document, services().objectives)
        if plain is not None:
            return V1Job(plain)
        try:
            return V1Job(SCHEMA.load(decoded.document))  # post_load builds the core's request
        except ValidationError as exc:
            raise schema_error(exc, NOT_AN_OBJECT) from None

    def render(self, job: V1Job, result: Result | None, device: torch.device,
               timed: Callable[[Iterable], Iterator]) -> Response:
        return Response(render_result(result, timed), mimetype="application/json")


def document_sizes(document: Any) -> Sizes | None:
    """The sizes from the lists' lengths; None when `vectors` is not a list of lists."""
    vectors = document.get("vectors") if isinstance(document, dict) else None
    if not (isinstance(vectors, list) and vectors and isinstance(vectors[0], list)):
        return None
    n, dim = len(vectors), len(vectors[0])
    factor = document.get("factor", default_factor(n))
    outputs = document.get("outputs", list(DEFAULT_OUTPUTS))
    valid_outputs = (isinstance(outputs, list) and outputs
                     and all(isinstance(name, str) and name in OUTPUTS for name in outputs))
    return request_sizes(n, dim, admissible_factor(factor, n), ordered_outputs(outputs) if valid_outputs else None,
                         objective=document.get("objective"), dtype=document.get("dtype"),
                         objectives=services().objectives)


FRONT_END = V1()
