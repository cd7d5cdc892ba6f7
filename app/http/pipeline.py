"""The one request path both front ends plug into, in the spirit of TorchServe's handler
(preprocess, inference, postprocess):

read the body -> decode the document or header -> admit once from the sizes, before any
number is converted (the body's memory reservation resized to the prediction, for the most
compute slots the request may take) -> convert -> take a compute slot -> run (the
executor spreads the chunks over free slots) -> render -> stream, holding a slot only while
a band of blocks is recomputed (app/http/slot.py) -> record (request_record.py, when the
last byte is written).

A front end supplies `accept`, `decode`, `convert` and `render` (`FrontEnd`), nothing else.
"""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from flask import Request, Response, g, request

from ..core import slots as deadline_module  # Deadline looked up per request (tests replace it)
from ..core.admission import AnswerCost, admit
from ..core.device import ready_device
from ..core.request import GradientRequest, Sizes
from ..core.run import Result, run
from ..core.slots import Ticket
from ..extensions import services
from .connection import cancel_probe
from .memory import reserve_for_request
from . import parsing  # parsing.read_body looked up per request (tests replace it)
from .request_record import RequestRecord
from .slot import BandSlots


@dataclass(frozen=True)
class Decoded:
    """A request read and decoded, no number converted yet."""
    sizes: Sizes | None  # None: not even N and D are known (conversion refuses the request)
    answer: AnswerCost  # how the front end holds the input and writes the answer
    document: Any  # the front end's own, handed to its `convert`
    logged_outputs: tuple[str, ...] | None = None  # the outputs as the front end names them; None: sizes.outputs


class Job(Protocol):
    """A converted request: the core's request and whatever the front end renders from."""
    gradient: GradientRequest
    logged_outputs: tuple[str, ...]  # the outputs as the front end names them, for the log line


class FrontEnd(Protocol):
    def accept(self, request: Request) -> None:
        """Refuse a body this front end does not read (415), before it is read."""

    def decode(self, body: bytes, request: Request) -> Decoded:
        ...

    def convert(self, decoded: Decoded) -> Job:
        ...

    def render(self, job: Job, result: Result | None, device: torch.device,
               timed: Callable[[Iterable], Iterator]) -> Response:
        """`result` None: the job computes nothing; `timed` wraps blocks taken from the result."""


def serve(front_end: FrontEnd) -> Response:
    served = services()  # one lookup through Flask's proxies for the whole request
    settings = served.settings
    front_end.accept(request)
    decoded = front_end.decode(parsing.read_body(request), request)
    sizes = decoded.sizes
    if sizes is not None:
        if sizes.factor is not None and sizes.outputs is not None:
            logged = sizes.outputs if decoded.logged_outputs is None else decoded.logged_outputs
            g.work = RequestRecord.of(sizes.n, sizes.dim, sizes.factor, logged, sizes.outputs)  # logged even when refused
        prediction = admit(sizes, decoded.answer, settings, served.executor.most_lanes)
        if prediction is not None:
            reserve_for_request(prediction.bytes)  # the body's reservation, resized to the prediction
    job = front_end.convert(decoded)
    req = job.gradient
    g.work = record = RequestRecord.of(req.n, req.dim, req.factor, job.logged_outputs, req.outputs)
    if not req.outputs:  # nothing to compute: no slot taken
        device = ready_device(settings.device)
        g.device = str(device)
        return front_end.render(job, None, device, record.timed)
    deadline = request_deadline()
    ticket = compute_slot(deadline)  # the request's first slot; its executor may take more
    try:
        with record.computing():
            result = run(req, settings, deadline, served.executor)
        result.band_slot = BandSlots(served.gate, deadline)  # blocks recomputed as written
        g.device = str(result.device)
        return front_end.render(job, result, result.device, record.timed)
    finally:
        ticket.release()  # the answer is written without it; recomputed bands take one each


def compute_slot(deadline: deadline_module.Deadline) -> Ticket:
    """Wait for a compute slot (overloaded / deadline_exceeded / client_closed)."""
    return services().gate.acquire(deadline)


def request_deadline() -> deadline_module.Deadline:
    """This request's deadline, counted from its arrival; stops when its client goes away."""
    return deadline_module.Deadline(services().settings.request_timeout_s, started=g.get("arrived"),
                                    cancelled=cancel_probe(request.environ))
