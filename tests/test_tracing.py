"""Traces (docs/operations.md, "Traces") on the server users run (tools/server.py, as `make
serve` starts it, with the embedded Dask cluster), exporting OTLP/HTTP to a receiver on
loopback (tests/otlp_receiver.py): a /v1 request and a gRPC ModelInfer carrying a W3C
traceparent get a server span, the caller's span's child, and a span per stage, in the
caller's trace, from service.name blockgrad; a job's tile and finish tasks are spans of the POST's trace,
made in a Dask worker process. Every wait is bounded; verdicts are spans and ids, never times."""
import json
import secrets

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton

from tests.otlp_receiver import Receiver
from tools.server import gunicorn_server, wait_until

pytestmark = pytest.mark.slow
WAIT_S = 120
STAGES = {"decode", "admit", "compute", "render"}


@pytest.fixture(scope="module")
def receiver():
    started = Receiver()
    yield started
    started.close()


@pytest.fixture(scope="module")
def server(receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1"}
    with gunicorn_server(workers=1, env=env) as started:
        yield started


def caller() -> tuple[str, str, str]:
    """(trace id, the caller's span id, its traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def log_line(server, request_id: str) -> dict:
    def found():
        lines = (json.loads(text) for text in server.log().splitlines() if text.startswith('{"ts"'))
        return next((line for line in lines if line.get("request_id") == request_id), None)
    assert wait_until(lambda: found() is not None, WAIT_S), f"no log line for {request_id}"
    return found()


def check_request_trace(received, trace_id: str, parent_id: str, server_name: str) -> dict:
    """The server span is the caller's span's child, each stage the server span's; one service."""
    [served] = [got for got in received if got.name == server_name]
    assert served.span.parent_span_id.hex() == parent_id
    assert served.span.kind == served.span.SPAN_KIND_SERVER
    for got in received:
        assert got.resource["service.name"] == "blockgrad"
        if got.name in STAGES:
            assert got.span.parent_span_id == served.span.span_id, got.name
    return {got.name: got for got in received}


def test_a_v1_request_with_a_traceparent_is_its_callers_child_with_a_span_per_stage(server, receiver):
    trace_id, parent_id, traceparent = caller()
    body = {"vectors": np.random.default_rng(0).uniform(-1, 1, (12, 3)).tolist(), "factor": 3}
    answer = requests.post(server.url + "/v1/gradients", json=body, headers={"traceparent": traceparent},
                           timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    spans = check_request_trace(receiver.wait_for(trace_id, STAGES | {"POST /v1/gradients"}, WAIT_S),
                                trace_id, parent_id, "POST /v1/gradients")
    served = spans["POST /v1/gradients"]
    assert served.span.status.code == served.span.status.STATUS_CODE_UNSET
    request_id = answer.headers["X-Request-ID"]
    names = ("request_id", "n", "dim", "factor", "objective", "status", "outcome")
    assert tuple(served.attribute(f"blockgrad.{name}") for name in names) == (request_id, 12, 3, 3, "sum", 200, "ok")
    assert spans["compute"].attribute("blockgrad.chunks") >= 1
    order = [spans[name].span for name in ("decode", "admit", "compute", "render")]  # one after another
    assert order[0].start_time_unix_nano == served.span.start_time_unix_nano
    assert [a.end_time_unix_nano == b.start_time_unix_nano for a, b in zip(order, order[1:])] == [True] * 3
    assert order[-1].end_time_unix_nano == served.span.end_time_unix_nano
    line = log_line(server, request_id)
    assert (line["trace_id"], line["span_id"]) == (trace_id, served.span.span_id.hex())


def test_a_refused_request_is_traced_with_its_error_code(server, receiver):
    trace_id, parent_id, traceparent = caller()
    answer = requests.post(server.url + "/v1/gradients", json={"vectors": [[1.0], [2.0]], "factor": 5},
                           headers={"traceparent": traceparent}, timeout=WAIT_S)
    assert answer.status_code == 422, answer.text
    spans = check_request_trace(receiver.wait_for(trace_id, {"POST /v1/gradients", "admit"}, WAIT_S), trace_id,
                                parent_id, "POST /v1/gradients")
    assert spans["POST /v1/gradients"].attribute("blockgrad.outcome") == "validation_error"
    status = spans["POST /v1/gradients"].span.status
    assert (status.code, status.message) == (status.STATUS_CODE_ERROR, "validation_error")
    assert spans["admit"].attribute("blockgrad.outcome") == "validation_error"
    assert "compute" not in spans


def test_grpc_model_infer_with_traceparent_metadata(server, receiver):
    trace_id, parent_id, traceparent = caller()
    x = np.random.default_rng(1).uniform(-1, 1, (9, 2)).astype(np.float32)
    tensor = triton.InferInput("vectors", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    triton.InferenceServerClient(server.grpc_target).infer("blockgrad", [tensor], parameters={"factor": 3},
                                                           headers={"traceparent": traceparent})
    name = "GRPC /inference.GRPCInferenceService/ModelInfer"
    spans = check_request_trace(receiver.wait_for(trace_id, STAGES | {name}, WAIT_S), trace_id, parent_id, name)
    assert spans[name].attribute("blockgrad.n") == 9


def test_a_jobs_tasks_are_spans_of_the_posts_trace_from_a_dask_worker(server, receiver):
    """Its tile tasks and its finish task (a job this small has one tile and no band task: the
    graph's band spans are tests/test_tracing_setup.py's)."""
    trace_id, parent_id, traceparent = caller()
    body = {"vectors": np.random.default_rng(2).uniform(-1, 1, (20, 3)).tolist(), "factor": 4}
    posted = requests.post(server.url + "/v1/jobs", json=body, headers={"traceparent": traceparent}, timeout=WAIT_S)
    assert posted.status_code == 202, posted.text
    received = receiver.wait_for(trace_id, {"POST /v1/jobs", "submit", "tile", "finish"}, WAIT_S)
    [post] = [got for got in received if got.name == "POST /v1/jobs"]
    assert post.span.parent_span_id.hex() == parent_id
    tasks = [got for got in received if got.name in ("tile", "finish")]
    [submit] = [got for got in received if got.name == "submit"]
    web = {server.pid, *server.worker_pids()}
    for task in tasks:  # the POST's span's children, made by another process: a Dask worker
        assert task.span.parent_span_id == post.span.span_id
        # after the job was stored (the submit span ends at its commit), so after the 202's decision
        assert task.span.start_time_unix_nano >= submit.span.end_time_unix_nano
        assert task.resource["service.name"] == "blockgrad"
        assert task.resource["process.pid"] not in web


def test_a_caller_that_does_not_sample_gets_its_answer_and_no_span(server, receiver):
    """traceparent flags 00: the SDK's parent-based sampler records nothing of the request. Its
    spans would be queued before those of the sampled request that follows it, so once that
    one's have arrived, the first's would have too."""
    unsampled, _, traceparent = caller()
    body = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]], "factor": 1}
    answer = requests.post(server.url + "/v1/gradients", json=body, headers={"traceparent": traceparent[:-2] + "00"},
                           timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    assert log_line(server, answer.headers["X-Request-ID"])["trace_id"] == unsampled
    sampled, _, traceparent = caller()
    assert requests.post(server.url + "/v1/gradients", json=body, headers={"traceparent": traceparent},
                         timeout=WAIT_S).status_code == 200
    receiver.wait_for(sampled, STAGES, WAIT_S)
    assert receiver.of_trace(unsampled) == []
