"""gRPC (docs/api.md, "gRPC"): the Open Inference Protocol's GRPCInferenceService and
grpc.health.v1, driven as users drive them (tritonclient.grpc, grpc's own stubs) against
gunicorn as `make serve` starts it (tools/server.py: every server gets a free gRPC port).

- health, metadata and ModelInfer with parameters and the token, equal to the oracle
  (tests/oracle.py, independent of the service) and to /v1's answer, FP32 and FP64;
- each mapped status from its real condition, with the table's message (the one /v2 writes)
  and the code in the trailing metadata;
- at a known point (every compute slot held by the test, calls waiting in line): the cap on
  concurrent calls, a full line, a client's cancel (the call never computes), a gRPC deadline,
  then SIGTERM: the calls in flight finish;
- calls whose message never comes (none sent, or part of one over a raw HTTP/2 connection)
  end at BLOCKGRAD_READ_TIMEOUT_S and free their places in the cap; a health Watch is UNIMPLEMENTED;
- a call cancelled while it computes ends there (CANCELLED, never OK);
- the master never loads grpcio; a taken or public port stops the start naming the variable.

Verdicts are statuses, counts and log lines, never times; every wait is bounded by WAIT_S.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from tests.events import HeldSlots, background
from tests.numeric import RTOL
from tests.oracle import assert_matches_oracle, request_oracle
from tests.test_startstop import refused
from tools.server import ROOT, free_port, gunicorn_command, gunicorn_server, wait_until

pytestmark = pytest.mark.slow

WAIT_S = 120
TOKEN = "grpc-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MESSAGE_LIMIT = 1024 * 1024
DATATYPES = {"float32": "FP32", "float64": "FP64"}
OUTPUT_NAMES = ("block_gradients", "accumulated", "bounds", "losses")


def test_gunicorn_config_loads_no_grpc():
    """The master imports gunicorn.conf.py and the hooks: grpcio must wait for the fork."""
    code = ("import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpc_health', 'tritonclient')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=2, env={"BLOCKGRAD_API_TOKEN": TOKEN,
                                         "BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES": str(MESSAGE_LIMIT)}) as started:
        yield started


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def trailing(error: grpc.RpcError) -> dict:
    return dict(error.trailing_metadata() or ())


def failure(rpc, message, metadata=AUTH) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        rpc(message, metadata=metadata, timeout=WAIT_S)
    return caught.value


def log_lines(server) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith('{"ts"')]


def log_line(server, request_id: str) -> dict:
    found = []
    assert wait_until(lambda: found.extend(l for l in log_lines(server) if l.get("request_id") == request_id)
                      or found, WAIT_S), f"no log line for {request_id}"
    return found[0]


def vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, (n, dim))


def infer_request(x: np.ndarray, datatype: str = "FP32", outputs=(), request_id: str = "", **parameters):
    message = pb.ModelInferRequest(model_name="blockgrad", id=request_id)
    message.inputs.add(name="vectors", datatype=datatype, shape=x.shape)
    message.raw_input_contents.append(x.astype(np.float32 if datatype == "FP32" else np.float64).tobytes())
    for name in outputs:
        message.outputs.add(name=name)
    for key, value in parameters.items():
        field = {str: "string_param", int: "int64_param", float: "double_param"}[type(value)]
        setattr(message.parameters[key], field, value)
    return message


# --- health and metadata


def test_health_and_liveness_are_open_and_metadata_needs_the_token(server, stub):
    client = triton.InferenceServerClient(server.grpc_target)
    assert client.is_server_live() and client.is_server_ready()
    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        checked = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        with pytest.raises(grpc.RpcError) as watched:  # it would hold a place in the cap while it lasts
            next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S))
    assert watched.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    for rpc, message in [(stub.ServerMetadata, pb.ServerMetadataRequest()),
                         (stub.ModelMetadata, pb.ModelMetadataRequest(name="blockgrad")),
                         (stub.ModelReady, pb.ModelReadyRequest(name="blockgrad")),
                         (stub.ModelInfer, infer_request(vectors(4, 2)))]:
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            error = failure(rpc, message, metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, error)
            assert trailing(error)["blockgrad-error-code"] == "unauthorized"
    headers = dict(AUTH)
    assert client.is_model_ready("blockgrad", headers=headers)
    assert client.get_server_metadata(headers=headers).name == "blockgrad"
    meta = client.get_model_metadata("blockgrad", headers=headers)
    assert (meta.name, list(meta.versions), meta.platform) == ("blockgrad", ["1"], "pytorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("vectors", "FP32", [-1, -1])]
    assert [(t.name, list(t.shape)) for t in meta.outputs] == [
        ("block_gradients", [-1, -1, -1]), ("accumulated", [-1, -1]), ("bounds", [-1]), ("losses", [-1, -1])]


def test_an_rpc_not_served_is_unimplemented(stub):
    error = failure(stub.ModelConfig, pb.ModelConfigRequest(name="blockgrad"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


# --- inference


CASES = [("float32", "sum", 3, 0.25), ("float64", "sum", 3, 0.25), ("float32", "logsumexp", 4, 0.0),
         ("float64", "sum_of_squares", 1, 0.0), ("float64", "l2_norm", 5, 0.0), ("float32", "mean", 2, 7)]


@pytest.mark.parametrize("dtype,objective,factor,offset", CASES)
def test_infer_equals_the_oracle_and_v1(server, dtype, objective, factor, offset):
    x = vectors(13, 3, seed=factor).astype(dtype)
    parameters = {"factor": factor, "objective": objective, "offset": offset}  # offset a float, or an int
    tensor = triton.InferInput("vectors", list(x.shape), DATATYPES[dtype])
    tensor.set_data_from_numpy(x)
    result = triton.InferenceServerClient(server.grpc_target).infer(
        "blockgrad", [tensor], parameters=parameters, headers=dict(AUTH))
    request = {"vectors": x.tolist(), "dtype": dtype, "outputs": ["blocks", "accumulated", "losses"], **parameters}
    answer = response_as_v1(result, request)
    assert_matches_oracle(request, answer, request_oracle(request))
    v1 = requests.post(server.url + "/v1/gradients", json=request, headers={"Authorization": f"Bearer {TOKEN}"},
                       timeout=WAIT_S).json()
    for name, grpc_name in [("accumulated", "accumulated"), ("losses", "losses")]:
        np.testing.assert_allclose(result.as_numpy(grpc_name), np.array(v1[name]), rtol=RTOL[dtype], atol=0)
    assert result.as_numpy("accumulated").dtype == np.dtype(dtype)
    assert result.as_numpy("bounds").tolist() == v1["bounds"]


def response_as_v1(result, request: dict) -> dict:
    """A gRPC answer written as /v1's body (for the oracle's check)."""
    bounds = result.as_numpy("bounds").tolist()
    grid, losses = result.as_numpy("block_gradients"), result.as_numpy("losses")
    used = {key: triton_parameter(value) for key, value in result.get_response().parameters.items()}
    n, dim = result.as_numpy("accumulated").shape
    f = len(bounds) - 1
    blocks = [{"row": r, "col": c, "rows": bounds[r:r + 2], "cols": bounds[c:c + 2], "loss": float(losses[r, c]),
               "gradient": grid[bounds[r]:bounds[r + 1], bounds[c]:bounds[c + 1]]} for r in range(f) for c in range(f)]
    assert used["offset"] == request["offset"] and type(used["factor"]) is int
    return {"n": n, "dim": dim, "factor": used["factor"], "bounds": bounds, "objective": used["objective"],
            "dtype": request["dtype"], "device": used["device"], "blocks": blocks,
            "accumulated": result.as_numpy("accumulated"), "losses": losses}


def triton_parameter(parameter):
    return getattr(parameter, parameter.WhichOneof("parameter_choice"))


def test_typed_contents_and_a_subset_of_outputs_with_the_request_id_echoed(server, stub):
    x = vectors(6, 2)
    message = infer_request(x, "FP64", outputs=("losses", "bounds"), factor=2)
    del message.raw_input_contents[:]
    message.inputs[0].contents.fp64_contents.extend(x.reshape(-1).tolist())
    answer, call = stub.ModelInfer.with_call(message, metadata=AUTH + (("x-request-id", "grpc-typed-1"),),
                                             timeout=WAIT_S)
    assert [o.name for o in answer.outputs] == ["losses", "bounds"]
    losses = np.frombuffer(answer.raw_output_contents[0], "<f8").reshape(2, 2)
    expected = request_oracle({"vectors": x.tolist(), "dtype": "float64", "factor": 2, "offset": 5.0}).losses
    np.testing.assert_allclose(losses, expected.astype(np.float64), rtol=RTOL["float64"])
    assert dict(call.trailing_metadata())["x-request-id"] == "grpc-typed-1"
    line = log_line(server, "grpc-typed-1")
    assert (line["method"], line["route"], line["status"]) == ("GRPC", "/inference.GRPCInferenceService/ModelInfer", "OK")
    assert line["outputs"] == ["losses", "bounds"] and line["n"] == 6


# --- errors: each status from its real condition


def v2_message(server, body: dict) -> str:
    """What /v2 answers the same request (the table's message)."""
    answer = requests.post(server.url + "/v2/models/blockgrad/infer", json=body, timeout=WAIT_S,
                           headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code >= 400, answer.text
    return answer.json()["error"]


def v2_body(x: np.ndarray, **parameters) -> dict:
    return {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.astype(np.float32).reshape(-1).tolist()}], "parameters": parameters}


@pytest.mark.parametrize("parameters", [{"factor": 9}, {"objective": "median"}, {"offset": "high"}, {"colour": "red"}])
def test_an_invalid_request_is_invalid_argument_with_v2s_message(server, stub, parameters):
    x = vectors(4, 2)
    error = failure(stub.ModelInfer, infer_request(x, **parameters))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailing(error)["blockgrad-error-code"] in ("validation_error", "invalid_request")
    assert error.details() == v2_message(server, v2_body(x, **parameters))


def test_an_unknown_model_is_not_found(stub):
    message = infer_request(vectors(4, 2))
    message.model_name = "resnet"
    error = failure(stub.ModelInfer, message)
    assert error.code() == grpc.StatusCode.NOT_FOUND and trailing(error)["blockgrad-error-code"] == "model_not_found"


def test_an_answer_over_the_message_limit_is_refused_before_computing(server, stub):
    before = len([l for l in log_lines(server) if l.get("compute_ms")])
    x = vectors(96, 8)  # block_gradients alone: 96 x 96 x 16 float32 = 576 KiB; FP64: 1.1 MiB
    error = failure(stub.ModelInfer, infer_request(x, "FP64", request_id="big", factor=2))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailing(error)["blockgrad-error-code"] == "limit_exceeded"
    assert f"over BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES = {MESSAGE_LIMIT}" in error.details()
    line = log_line(server, trailing(error)["x-request-id"])
    assert line["error"] == "limit_exceeded" and line.get("compute_ms", 0) == 0  # never computed
    assert stub.ModelInfer(infer_request(x, "FP32", factor=2), metadata=AUTH, timeout=WAIT_S).outputs
    # Logged once the call has ended, maybe after the client has its answer.
    assert wait_until(lambda: len([l for l in log_lines(server) if l.get("compute_ms")]) > before, WAIT_S)


def test_a_request_over_the_message_limit_is_resource_exhausted(server, stub):
    """grpcio refuses it with its own status; the call is not logged as an invalid request."""
    error = failure(stub.ModelInfer, infer_request(vectors(4200, 64)),  # 4200 x 64 x 4 bytes: over 1 MiB
                    AUTH + (("x-request-id", "grpc-too-big"),))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stub.ServerLive(pb.ServerLiveRequest(), metadata=(("x-request-id", "grpc-after-too-big"),), timeout=WAIT_S)
    log_line(server, "grpc-after-too-big")  # logged after the refused call's would have been
    assert not [line for line in log_lines(server) if line.get("request_id") == "grpc-too-big"]


@pytest.mark.parametrize("method", ["/inference.GRPCInferenceService/ModelInfer", "/grpc.health.v1.Health/Check"])
def test_bytes_that_are_no_message_are_invalid_argument_not_a_server_failure(server, method):
    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(method)(b"\xff\xff\xff\xff garbage", metadata=AUTH, timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert trailing(caught.value)["blockgrad-error-code"] == "validation_error"
    assert "not a valid" in caught.value.details()
    assert not [line for line in log_lines(server) if line.get("error") == "internal_error"]


def test_an_unusable_device_is_not_ready_and_unavailable():
    with gunicorn_server(workers=1, device="cuda:9") as started, grpc.insecure_channel(started.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=WAIT_S).ready
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # as /readyz: a gRPC probe sees it
        error = failure(stub.ModelInfer, infer_request(vectors(4, 2)), ())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and trailing(error)["blockgrad-error-code"] == "not_ready"


def test_grpc_requests_are_in_the_request_metrics(server, stub):
    assert stub.ModelInfer(infer_request(vectors(4, 2)), metadata=AUTH, timeout=WAIT_S).outputs
    assert failure(stub.ModelInfer, infer_request(vectors(4, 2), factor=9)).code() == grpc.StatusCode.INVALID_ARGUMENT

    def statuses() -> set[str]:  # a call is counted once it has ended, maybe after its client has the answer
        text = requests.get(server.url + "/metrics", timeout=WAIT_S).text
        return {re.search(r'status="(\w+)"', line)[1] for line in text.splitlines()
                if line.startswith("blockgrad_requests_total{")
                and 'route="/inference.GRPCInferenceService/ModelInfer"' in line and 'method="GRPC"' in line}
    assert wait_until(lambda: {"OK", "INVALID_ARGUMENT"} <= statuses(), WAIT_S), statuses()


# --- at a known point: every compute slot held by the test


@pytest.fixture(scope="module")
def held_server():
    """One worker, three gRPC calls at once (its threads), two waiting in line for a slot; a
    message may take as long as the tests run to arrive. The cap test, its only user, stops it."""
    with gunicorn_server(workers=1, env={"GUNICORN_CMD_ARGS": "--threads 3", "BLOCKGRAD_QUEUE_DEPTH": "2",
                                         "BLOCKGRAD_READ_TIMEOUT_S": "900"}) as started:
        yield started


INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"


def silent_call(channel, never: threading.Event, request_id: str = "silent"):
    """A ModelInfer whose client sends its headers, then never its message (until `never` is set)."""
    def no_message():
        never.wait(WAIT_S)
        yield from ()
    return channel.stream_unary(INFER_PATH).future(no_message(), metadata=(("x-request-id", request_id),),
                                                    timeout=WAIT_S)


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def partial_message_call(target: str) -> socket.socket:
    """A raw HTTP/2 connection (frames by hand: the h2 package is not installed) that opens one
    ModelInfer and sends 10 bytes of a 1,000-byte message, never the rest: a slow upload."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", INFER_PATH.encode()),
              (b":authority", target.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    headers = b"".join(b"\0" + bytes([len(name)]) + name + bytes([len(value)]) + value  # HPACK literals
                       for name, value in fields)
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers)
                 + frame(0, 0, 1, b"\0" + (1000).to_bytes(4, "big") + bytes(10)))
    return sock


def stream_ended(sock: socket.socket) -> str:
    """Reads the server's frames (acknowledging its SETTINGS and PINGs) until the call's stream
    ends: its trailers (HEADERS with END_STREAM), RST_STREAM, or the connection's GOAWAY."""
    def exactly(count: int) -> bytes:
        data = b""
        while len(data) < count:
            piece = sock.recv(count - len(data))
            assert piece, "connection closed"
            data += piece
        return data
    while True:
        head = exactly(9)
        kind, flags, stream = head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF
        payload = exactly(int.from_bytes(head[:3], "big"))
        if kind in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledged
            sock.sendall(frame(kind, 1, 0, payload if kind == 6 else b""))
        if stream == 1 and (kind == 3 or kind == 1 and flags & 1) or kind == 7:
            return {1: "trailers", 3: "reset", 7: "goaway"}[kind]


@pytest.fixture(scope="module")
def bounded_server():
    """One worker, two gRPC calls at once, a request message bounded by 2 s."""
    with gunicorn_server(workers=1, env={"GUNICORN_CMD_ARGS": "--threads 2", "BLOCKGRAD_READ_TIMEOUT_S": "2",
                                         "BLOCKGRAD_REQUEST_TIMEOUT_S": "120"}) as started:
        yield started


def test_calls_whose_message_never_comes_end_at_the_read_timeout_and_free_the_cap(bounded_server):
    """Both of a worker's places in the cap taken by calls whose message never comes (none sent,
    or part of one): each ends DEADLINE_EXCEEDED (read_timeout) once BLOCKGRAD_READ_TIMEOUT_S
    has passed, logged, and the next ModelInfer gets an answer. A call that ends without a
    message is INVALID_ARGUMENT."""
    server, never = bounded_server, threading.Event()
    before = len([line for line in log_lines(server) if line.get("error") == "read_timeout"])
    with grpc.insecure_channel(server.grpc_target) as channel, partial_message_call(server.grpc_target) as raw:
        try:
            silent = silent_call(channel, never, "grpc-silent")
            reader, ended = background(lambda: stream_ended(raw))
            reader.start()
            error = silent.exception(WAIT_S)
            reader.join(WAIT_S)
            assert ended == ["trailers"] or ended == ["reset"], ended
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert trailing(error)["blockgrad-error-code"] == "read_timeout"
            assert "BLOCKGRAD_READ_TIMEOUT_S = 2 s" in error.details()
            answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request(vectors(4, 2)), timeout=WAIT_S)
            assert [o.name for o in answer.outputs] == list(OUTPUT_NAMES)
            line = log_line(server, "grpc-silent")
            assert (line["status"], line["error"]) == ("DEADLINE_EXCEEDED", "read_timeout")
            assert wait_until(lambda: len([l for l in log_lines(server) if l.get("error") == "read_timeout"])
                              == before + 2, WAIT_S), "the partial message's call was not logged"
            with pytest.raises(grpc.RpcError) as empty:
                channel.stream_unary(INFER_PATH)(iter(()), timeout=WAIT_S)
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailing(empty.value)["blockgrad-error-code"] == "validation_error"
        finally:
            never.set()


def metric(server, name: str) -> float:
    """One unlabelled sample of /metrics (0 until it is written)."""
    for line in requests.get(server.url + "/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def computing_started(server) -> float:
    """Computing requests that have taken a compute slot so far."""
    return metric(server, "blockgrad_queue_wait_seconds_count")


def test_a_call_cancelled_while_computing_stops_and_frees_the_slot(bounded_server):
    """A long ModelInfer (8192 x 128, F = 64: thousands of chunks) cancelled once it computes
    ends at its next chunk: logged CANCELLED (client_closed), never OK nor past its deadline,
    and the next call computes."""
    server, x = bounded_server, np.zeros((8192, 128))
    started = computing_started(server)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        long = stub.ModelInfer.future(infer_request(x, outputs=("accumulated",), factor=64), timeout=WAIT_S,
                                      metadata=(("x-request-id", "grpc-long"),))
        assert wait_until(lambda: computing_started(server) == started + 1, WAIT_S), "it never computed"
        long.cancel()
        line = log_line(server, "grpc-long")
        assert (line["status"], line.get("error")) == ("CANCELLED", "client_closed")
        assert stub.ModelInfer(infer_request(vectors(4, 2)), timeout=WAIT_S).outputs


def queue_depth(server) -> float:
    return metric(server, "blockgrad_queue_depth")


def test_the_master_never_loads_grpcio(bounded_server):
    [worker] = bounded_server.worker_pids()
    assert "cygrpc" in open(f"/proc/{worker}/maps").read()
    assert "cygrpc" not in open(f"/proc/{bounded_server.pid}/maps").read()


def test_the_readme_and_api_examples_run(bounded_server):
    """README's one-liner and docs/api.md's snippet, against this server's gRPC port."""
    readme = (ROOT / "README.md").read_text()
    code, shown = re.search(r"^\.venv/bin/python -c '(.*)'  # (.*)$", readme, re.M).groups()
    [snippet] = [block for block in re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "api.md").read_text(),
                                               re.S | re.M) if "tritonclient.grpc" in block]
    printed = []
    for source in (code, snippet):
        assert "127.0.0.1:8001" in source
        done = subprocess.run([sys.executable, "-c", source.replace("127.0.0.1:8001", bounded_server.grpc_target)],
                              cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.strip())
    assert printed[0] == shown == "(2, 2)"
    assert printed[1].startswith("[[") and len(re.findall(r"\d+\.\d*(?:e[-+]?\d+)?", printed[1])) == 4  # (2, 2)


def test_cap_line_cancel_deadline_and_drain_at_known_points(held_server):
    """A call whose message has not come holds one place; two ModelInfer wait for the held
    slots: the next call is past the cap (RESOURCE_EXHAUSTED at once); with the first call
    cancelled it reaches a full line
    (UNAVAILABLE overloaded); a cancelled call never computes (CANCELLED, logged client_closed);
    a call with a gRPC deadline ends DEADLINE_EXCEEDED; SIGTERM, then the slots let go: the
    call in flight still gets its whole answer."""
    server, x, never = held_server, vectors(10, 3), threading.Event()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        silent = silent_call(channel, never)  # on the same connection as the calls below, before them
        with HeldSlots(server):
            kept = stub.ModelInfer.future(infer_request(x, request_id="kept", factor=2), timeout=WAIT_S)
            gone = stub.ModelInfer.future(infer_request(x, request_id="gone", factor=2), timeout=WAIT_S,
                                          metadata=(("x-request-id", "grpc-gone"),))
            assert wait_until(lambda: queue_depth(server) == 2, WAIT_S), "the calls never waited in line"
            capped = failure(stub.ModelInfer, infer_request(x), ())
            assert capped.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, capped

            silent.cancel()
            never.set()
            full = []
            assert wait_until(lambda: full.append(failure(stub.ModelInfer, infer_request(x), ()))
                              or full[-1].code() != grpc.StatusCode.RESOURCE_EXHAUSTED, WAIT_S)
            assert full[-1].code() == grpc.StatusCode.UNAVAILABLE, full[-1]
            assert trailing(full[-1])["blockgrad-error-code"] == "overloaded"

            gone.cancel()
            line = log_line(server, "grpc-gone")
            assert (line["status"], line["error"], line["compute_ms"]) == ("CANCELLED", "client_closed", 0)
            assert "output_numbers" not in line or line["output_numbers"] == 0

            thread, ended = background(lambda: stub.ModelInfer(infer_request(x), timeout=3,
                                                                metadata=(("x-request-id", "grpc-late"),)))
            thread.start()
            thread.join(WAIT_S)
            assert isinstance(ended[0], grpc.RpcError) and ended[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
            line = log_line(server, "grpc-late")
            assert (line["status"], line["error"]) == ("DEADLINE_EXCEEDED", "deadline_exceeded")

            http, answers = background(lambda: requests.post(server.url + "/v1/gradients", timeout=WAIT_S,
                                                             json={"vectors": x.tolist(), "factor": 2}))
            http.start()
            assert wait_until(lambda: queue_depth(server) == 2, WAIT_S), "the HTTP request never waited in line"
            assert not kept.done()
            os.kill(server.pid, signal.SIGTERM)  # gRPC drains at once, while HTTP's request is still in flight
            assert wait_until(lambda: refused(server.grpc_port), WAIT_S), "new gRPC connections still accepted"
            assert not kept.done() and answers == []
        answer = kept.result(WAIT_S)  # the slots let go: the calls in flight finish
        http.join(WAIT_S)
    assert [o.name for o in answer.outputs] == list(OUTPUT_NAMES) and answer.id == "kept"
    assert answers[0].status_code == 200
    assert server.process.wait(WAIT_S) == 0


def test_a_recycled_worker_finishes_its_grpc_calls_and_its_replacement_serves():
    """gunicorn recycles the one worker (max_requests) while a call waits for the held slots:
    the worker drains (its gRPC port refused: no replacement until it exits), the call gets its
    whole answer once the slots are let go, and the replacement binds the port again."""
    env = {"GUNICORN_CMD_ARGS": "--max-requests 6 --max-requests-jitter 0"}
    with gunicorn_server(workers=1, env=env) as server, grpc.insecure_channel(server.grpc_target) as channel:
        stub, x = pb_grpc.GRPCInferenceServiceStub(channel), vectors(10, 3)
        [first] = server.worker_pids()
        with HeldSlots(server):
            kept = stub.ModelInfer.future(infer_request(x, request_id="kept", factor=2), timeout=WAIT_S)
            assert wait_until(lambda: queue_depth(server) == 1, WAIT_S), "the call never waited in line"
            # HTTP requests until the worker reaches max_requests; draining, it answers none.
            assert wait_until(lambda: server.answers("/healthz") is None or refused(server.grpc_port), WAIT_S), \
                "the worker was never recycled"
            assert not kept.done() and server.worker_pids() == [first]
        assert kept.result(WAIT_S).id == "kept"
        assert wait_until(lambda: server.worker_pids() not in ([], [first]) and server.answers("/healthz"),
                          WAIT_S), "no replacement"  # it answers HTTP once its gRPC server is up
        assert stub.ModelInfer(infer_request(x), timeout=WAIT_S, wait_for_ready=True).outputs


# --- the start


@pytest.mark.parametrize("reuse_port", [False, True], ids=["any listener", "another blockgrad (SO_REUSEPORT)"])
def test_a_taken_grpc_port_stops_the_start_naming_the_variable(reuse_port):
    with socket.socket() as listener:
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        done = start({"BLOCKGRAD_GRPC_BIND": f"127.0.0.1:{port}"})
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    [line] = [line for line in log.splitlines() if "BLOCKGRAD_GRPC_BIND" in line]
    assert f"127.0.0.1:{port}" in line and "already in use" in line
    assert "Booting worker" not in log


def test_the_http_port_for_grpc_stops_the_start_naming_both():
    port = free_port()
    done = start({"BLOCKGRAD_BIND": f"127.0.0.1:{port}", "BLOCKGRAD_GRPC_BIND": f"127.0.0.1:{port}"})
    assert done.returncode == 1
    [line] = [line for line in (done.stdout + done.stderr).splitlines() if "BLOCKGRAD_GRPC_BIND" in line]
    assert "BLOCKGRAD_BIND has it" in line


def test_a_public_grpc_bind_without_a_token_refuses_to_start():
    done = start({"BLOCKGRAD_GRPC_BIND": f"0.0.0.0:{free_port()}"})
    assert done.returncode == 1 and "without BLOCKGRAD_API_TOKEN" in done.stdout + done.stderr


def start(env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "BLOCKGRAD_BIND": f"127.0.0.1:{free_port()}", "BLOCKGRAD_DASK_SCHEDULER": "off",
            "BLOCKGRAD_DEVICE": "cpu", **env}
    for name in ("BLOCKGRAD_API_TOKEN", "BLOCKGRAD_AUTH"):
        full.pop(name, None)
    return subprocess.run(gunicorn_command(), cwd=ROOT, env=full, capture_output=True, text=True, timeout=WAIT_S)
