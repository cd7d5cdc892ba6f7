"""The one request pipeline every front end plugs into, in the spirit of TorchServe's handler
(preprocess, inference, postprocess):

    decode -> validate -> admit (once) -> convert -> execute -> render

A front end is a decoder and a renderer; its view reads `render(pipeline(decode(request), http_call()))`
and nothing calls back into it in between. The decoder reads the body (body.read_body) and
describes the request without converting a number (`Described`: the sizes and fields as
sent, the raw vectors). The pipeline, the same for every front end, validates the sizes by
building the core's `Sizes` (N >= 1, D >= 1; a factor outside 1..N or an unknown dtype is
not admitted, and refused when converted), admits once, converts with the core (`to_matrix`,
`build_request`: the fields' errors and the vectors' together, after admission) and executes:
`compute` for /v1 and /v2 (a compute slot, then the engine), the job store's submit for
/v1/jobs, whose admission is its own limits'. The renderer turns what was executed into the
Response; the request is recorded when its last byte is written (record.py).

A traced request (record.begin started its span, `state.span`) gets a span per stage, each
from its start to the next's: decode (arrival to here), admit (validate, admit, convert, the
wait for a compute slot), compute (/v1/jobs: submit, the request's span current), and render
until its last byte. The stages are timestamps here; record.py makes their spans at the end.
"""
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from flask import current_app, g
from opentelemetry import trace

from ..core import slots  # slots.Deadline looked up per request (tests replace it)
from ..core.admission import AnswerCost, admit
from ..core.device import ready_device
from ..core.errors import validation_error
from ..core.objectives import Objective
from ..core.request import (GradientRequest, Sizes, build_request, default_factor, factor_refusal, ordered_outputs,
                            request_sizes)
from ..core.run import Result, run
from ..core.slots import Gate
from ..core.vectors import MatrixError, to_matrix
from ..extensions import KEY, Services
from .body import client_gone, reserve_for_request
from .record import RequestRecord


@dataclass(frozen=True)
class Described:
    """A request decoded, no number converted: what the pipeline validates, admits and converts."""
    n: int | None  # as sent (list lengths or a declared shape); None: not even rows (refused when converted)
    dim: int | None
    vectors: Any  # JSON rows, flat JSON data (`declared`), or an (N, D) array; None when `errors` name it
    fields: Mapping[str, Any]  # build_request's keyword values that are valid as sent (defaults included)
    errors: Mapping[str, list[str]] = field(default_factory=dict)  # the fields refused: raised after admission
    answer: AnswerCost | None = None  # how the front end holds the input and writes the answer
    declared: bool = False  # `vectors` must have the shape (n, dim) as declared (/v2), flat or nested
    logged_outputs: tuple[str, ...] | None = None  # the outputs as the front end names them; None: the core's
    own: Any = None  # the decoder's, handed to its renderer


@dataclass(frozen=True)
class Computed:
    """What `compute` hands the renderer."""
    request: GradientRequest
    result: Result | None  # None: nothing to compute (/v2 asking only for bounds)
    device: torch.device
    timed: Callable[[Iterable], Iterator]  # wraps the blocks taken from the result: their time is compute time
    own: Any


@dataclass(frozen=True)
class Call:
    """What the pipeline needs of the request it runs, handed over by its front end: the
    worker's services, where the request is recorded (`state`: it reads `arrived`, sets `work`,
    `device` and `memory_reservation`; Flask's `g` for HTTP), how to tell its client has gone,
    and its own deadline (gRPC's) under BLOCKGRAD_REQUEST_TIMEOUT_S."""
    served: Services
    state: Any
    cancelled: Callable[[], bool] | None = None
    timeout_s: float | None = None


def http_call() -> Call:
    """The Call of the Flask request being answered: its client is gone when its socket is."""
    state = g._get_current_object()
    sock = state.get("client_socket")  # record.before_request's
    return Call(current_app.extensions[KEY], state, None if sock is None else (lambda: client_gone(sock)))


Admit = Callable[[Sizes, Described, Services], None]
Execute = Callable[[GradientRequest, Described, Services], Any]


def pipeline(described: Described, call: Call, execute: Execute | None = None, admit_sizes: Admit | None = None) -> Any:
    """Validate, admit once, convert, execute (default: `compute`, admitted by `admit_to_compute`)."""
    served, span = call.served, getattr(call.state, "span", None)
    stages = None
    if span is not None and span.recording:  # not sampled: no stage spans
        stages = call.state.stages = [("decode", span.start_time, None), ("admit", time.time_ns(), None)]
    sizes = validated_sizes(described, served.objectives)
    if sizes is not None:
        if stages is not None:
            span.attributes.update({key: value for key, value in (
                ("blockgrad.n", sizes.n), ("blockgrad.dim", sizes.dim), ("blockgrad.factor", sizes.factor),
                ("blockgrad.objective", described.fields.get("objective"))) if value is not None})
        admit_sizes(sizes, described, served) if admit_sizes else admit_to_compute(sizes, described, call)
    req = convert(described, served.objectives)
    slot = take_slot(call) if execute is None and req.outputs else None  # its queue wait admission's
    if execute is None:
        executed = compute(req, described, call, slot)
    elif stages is None:
        executed = execute(req, described, served)
    else:
        stages.append(("submit", time.time_ns(), None))
        with trace.use_span(trace.NonRecordingSpan(span.context)):  # current: the job stores its traceparent
            executed = execute(req, described, served)
    if stages is not None:
        stages.append(("render", time.time_ns(), None))
    return executed


def validated_sizes(described: Described, objectives: Mapping[str, Objective]) -> Sizes | None:
    """The core's Sizes (validation_error on N or D of 0); None when N and D are not known."""
    n, fields, errors = described.n, described.fields, described.errors
    if n is None:
        return None
    factor = fields.get("factor", default_factor(n)) if "factor" not in errors else None
    outputs = ordered_outputs(fields["outputs"]) if "outputs" in fields and "outputs" not in errors else None
    return request_sizes(n, described.dim, factor, outputs,
                         objective=fields.get("objective"), dtype=fields.get("dtype"), objectives=objectives)


def admit_to_compute(sizes: Sizes, described: Described, call: Call) -> None:
    """The core's limits and prediction; the request's memory reservation resized to it."""
    served = call.served
    if sizes.factor is not None and sizes.outputs is not None:  # logged even when refused
        call.state.work = RequestRecord(sizes.n, sizes.dim, sizes.factor, described.logged_outputs or sizes.outputs,
                                        sizes.outputs)
    prediction = admit(sizes, described.answer, served.settings, served.executor.most_lanes)
    if prediction is not None:
        reserve_for_request(served.ledger, prediction.bytes, state=call.state)


def convert(described: Described, objectives: Mapping[str, Objective]) -> GradientRequest:
    """The checked (N, D) matrix and the core's request; every field's refusal in one 422."""
    errors, matrix = dict(described.errors), None
    if "vectors" not in errors:
        try:
            matrix = to_matrix(described.vectors, (described.n, described.dim) if described.declared else None)
        except MatrixError as exc:
            errors["vectors"] = [str(exc)]
    if errors:  # the factor's range beside the other refusals (build_request checks it otherwise)
        refusal = factor_refusal(described.fields.get("factor"), None if matrix is None else len(matrix))
        raise validation_error(errors if refusal is None else {**errors, "factor": [refusal]})
    return build_request(matrix, objectives=objectives, **described.fields)


def take_slot(call: Call) -> tuple[slots.Deadline, Any]:
    """The request's deadline and first compute slot (overloaded / deadline_exceeded /
    client_closed); its executor may take more."""
    deadline = request_deadline(call)
    return deadline, call.served.gate.acquire(deadline)


def compute(req: GradientRequest, described: Described, call: Call, slot: tuple | None = None) -> Computed:
    """Take a compute slot (unless `slot`: take_slot's), run the engine, give the slot back: the
    answer is written without it, and each band of blocks recomputed while it is written takes
    one again (BandSlots)."""
    n, dim = req.vectors.shape
    served, state = call.served, call.state
    state.work = record = RequestRecord(n, dim, req.factor, described.logged_outputs or req.outputs, req.outputs)
    if not req.outputs:  # nothing to compute: no slot taken
        device = ready_device(served.settings.device)
        state.device = str(device)
        return Computed(req, None, device, record.timed, described.own)
    deadline, ticket = slot or take_slot(call)
    start, stages = time.perf_counter(), getattr(state, "stages", None)
    try:
        if stages is not None:
            stages.append(("compute", time.time_ns(), computing := {}))
        result = run(req, served.settings, deadline, served.executor)
        if stages is not None:
            computing.update({"blockgrad.bands": result.planned[0], "blockgrad.chunks": result.planned[1],
                              "blockgrad.blocks_kept": result.kept is not None})
    finally:
        record.compute_s += time.perf_counter() - start
        ticket.release()
    result.band_slot = BandSlots(served.gate, deadline)
    state.device = str(result.device)
    return Computed(req, result, result.device, record.timed, described.own)


def request_deadline(call: Call) -> slots.Deadline:
    """This request's deadline, counted from its arrival; stops when its client goes away."""
    timeout_s = call.served.settings.request_timeout_s
    return slots.Deadline(timeout_s if call.timeout_s is None else min(timeout_s, call.timeout_s),
                          started=getattr(call.state, "arrived", None), cancelled=call.cancelled)


@dataclass(frozen=True)
class BandSlots:
    """`Result.band_slot` of a request: a compute slot while each band of blocks is
    recomputed, none while the band is written (`Gate.resume`: ahead of the line, never
    refused, against the request's deadline). So a client that reads slowly holds its
    thread, never a compute slot: another request computes meanwhile."""
    gate: Gate
    deadline: slots.Deadline

    @contextmanager
    def __call__(self) -> Iterator[None]:
        ticket = self.gate.resume(self.deadline)
        try:
            yield
        finally:
            ticket.release()  # before the band's blocks go to the socket
