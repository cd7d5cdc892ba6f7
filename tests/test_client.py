"""blockgrad_client (client/) against a real gunicorn, and its retries against a scripted stub."""
import json
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from werkzeug.serving import make_server

import blockgrad_client
from blockgrad_client import BlockgradError, Client
from blockgrad_client import infer as codec
from tools.reference import reference_accumulated, reference_blocks
from app import create_app
from app.extensions import services_of
from app.jobs import db
from tools.server import free_port, gunicorn_server, wait_until

from .numeric import assert_matches
from .client_stub import Answer, Close, Stall, stub_server
from .test_v2 import assert_matches_reference, reference_outputs

ROOT = Path(__file__).resolve().parent.parent
CLIENT_DIR = ROOT / "client"
TOKEN = "client-test-token"


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=1, env={"BLOCKGRAD_API_TOKEN": TOKEN}) as server:
        yield server


@pytest.fixture
def client(server):
    with Client(server.url, token=TOKEN, timeout=120) as client:
        yield client


def vectors(n: int, d: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(dtype)


# -- against the real service -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_equal_the_reference_loops(client, dtype):
    v = vectors(7, 3, dtype)
    result = client.gradients(v, factor=3, objective="sum_of_squares", dtype=dtype,
                              outputs=["blocks", "accumulated", "losses"])
    expected = reference_blocks(torch.from_numpy(v), 3, "sum_of_squares")
    assert (result.n, result.dim, result.factor, result.dtype) == (7, 3, 3, dtype)
    assert result.bounds.tolist() == [0, 2, 4, 7] and result.bounds.dtype == np.int64
    assert len(result.blocks) == 9 and result.accumulated.dtype == dtype and result.losses.shape == (3, 3)
    for k, (block, (loss, grad)) in enumerate(zip(result.blocks, expected, strict=True)):
        r, c = divmod(k, 3)
        assert (block.row, block.col) == (r, c)
        assert block.rows == (result.bounds[r], result.bounds[r + 1]) and block.cols[1] == result.bounds[c + 1]
        assert block.gradient.dtype == dtype and block.gradient.shape == tuple(grad.shape)
        assert_matches(block.gradient, grad, dtype, what=f"block {k} gradient")
        assert_matches(block.loss, loss, dtype, what=f"block {k} loss")
        assert block.loss == result.losses[r, c]
    assert_matches(result.accumulated, reference_accumulated(torch.from_numpy(v), 3, "sum_of_squares"), dtype,
                   what="accumulated")


@pytest.mark.slow
def test_stream_gradients_hands_out_blocks_one_at_a_time(client):
    v = vectors(6, 2, "float64", seed=1)
    with client.stream_gradients(v, factor=2, outputs=["blocks"], dtype="float64") as (head, blocks):
        assert head["bounds"].tolist() == [0, 3, 6] and "accumulated" not in head
        first = next(blocks)
        assert (first.row, first.col, first.gradient.shape) == (0, 0, (3, 3, 4))
        rest = list(blocks)
    assert [(b.row, b.col) for b in rest] == [(0, 1), (1, 0), (1, 1)]
    only_head = client.gradients(v, factor=2, outputs=["accumulated"])
    assert only_head.blocks == [] and only_head.losses is None and only_head.accumulated.shape == (6, 2)


@pytest.mark.slow
@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_infer_binary_equals_the_reference_loops(client, datatype):
    v = vectors(6, 2, {"FP32": "float32", "FP64": "float64"}[datatype], seed=2)
    tensors = client.infer(v, factor=2, objective="logsumexp")
    expected = reference_outputs(torch.from_numpy(v), 2, "logsumexp", 5.0, [0, 3, 6])
    assert_matches_reference(tensors, expected, datatype, ["block_gradients", "accumulated", "bounds", "losses"])
    picked = client.infer(v, outputs=["losses"], factor=2, objective="logsumexp")
    assert list(picked) == ["losses"] and np.array_equal(picked["losses"], tensors["losses"])


@pytest.mark.slow
def test_objectives_lists_the_builtins(client):
    listed = {entry["name"]: entry for entry in client.objectives()}
    assert set(listed) == {"sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"}  # no model dir here
    assert all(entry["kind"] == "builtin" and entry["dim"] is None for entry in listed.values())


@pytest.mark.slow
def test_errors_carry_status_code_message_and_details(client, server):
    with pytest.raises(BlockgradError) as info:
        client.gradients([[1.0, 2.0]], factr=2)
    assert (info.value.status, info.value.code) == (422, "validation_error")
    assert "factr" in info.value.details["fields"]
    with pytest.raises(BlockgradError) as info:
        client.gradients(np.zeros((2, 2)), factor=2, outputs=["blocks"], dtype="float64", objective="nope")
    assert info.value.code == "validation_error" and "objective" in info.value.details["fields"]
    with pytest.raises(BlockgradError) as info:  # /v2: the protocol's body, the code from the header
        client.infer(np.zeros((2, 2), np.float32), factor=3)
    assert (info.value.status, info.value.code) == (400, "validation_error") and "factor" in info.value.message
    with pytest.raises(BlockgradError) as info:
        client.infer(np.zeros((9000, 1), np.float32))
    assert (info.value.status, info.value.code) == (413, "limit_exceeded")
    with Client(server.url) as anonymous, pytest.raises(BlockgradError) as info:
        anonymous.gradients([[1.0]])
    assert (info.value.status, info.value.code) == (401, "unauthorized")
    with Client(server.url, token="wrong") as wrong, pytest.raises(BlockgradError) as info:
        wrong.infer(np.zeros((1, 1), np.float32))
    assert (info.value.status, info.value.code) == (401, "unauthorized")


@pytest.mark.slow
def test_connection_refused_is_connection_failed():
    with Client(f"http://127.0.0.1:{free_port()}", retries=1, timeout=5) as client, \
            pytest.raises(BlockgradError) as info:
        client.gradients([[1.0]])
    assert info.value.code == "connection_failed" and info.value.status is None


# -- retries, against a scripted stub ---------------------------------------------------------
V1_ANSWER = json.dumps({"n": 1, "dim": 1, "factor": 1, "bounds": [0, 1], "objective": "sum",
                        "dtype": "float32", "device": "cpu", "accumulated": [[4.0]],
                        "blocks": [{"row": 0, "col": 0, "rows": [0, 1], "cols": [0, 1], "loss": 12.0,
                                    "gradient": [[[1.0, 1.0]]]}]}).encode()


def error_answer(status: int, code: str, details: dict | None = None, retry_after: str | None = "0") -> Answer:
    body = {"error": {"code": code, "message": f"{code} here", "details": details or {}}}
    headers = {"X-Blockgrad-Error-Code": code, **({"Retry-After": retry_after} if retry_after else {})}
    return Answer(status, json.dumps(body).encode(), headers)


OVERLOADED = error_answer(503, "overloaded", {"queued": True})


def call(stub, retries: int = 3, deadline_s: float = 60.0, timeout: float = 10.0):
    with Client(stub.url, retries=retries, deadline_s=deadline_s, timeout=timeout) as client:
        return client.gradients([[1.0]], factor=1)


def test_overloaded_is_retried_after_retry_after_then_answers():
    with stub_server([OVERLOADED, OVERLOADED, Answer(body=V1_ANSWER)]) as stub:
        result = call(stub)
    assert len(stub.requests) == 3 and result.accumulated.tolist() == [[4.0]]
    assert result.blocks[0].gradient.tolist() == [[[1.0, 1.0]]]


def test_retries_are_bounded():
    with stub_server([OVERLOADED] * 5) as stub, pytest.raises(BlockgradError) as info:
        call(stub, retries=2)
    assert len(stub.requests) == 3 and (info.value.status, info.value.code) == (503, "overloaded")


def test_deadline_exceeded_is_retried_only_when_it_never_started():
    queued = error_answer(503, "deadline_exceeded", {"queued": True, "timeout_s": 1})
    ran = error_answer(503, "deadline_exceeded", {"timeout_s": 1})
    with stub_server([queued, Answer(body=V1_ANSWER)]) as stub:
        call(stub)
    assert len(stub.requests) == 2
    with stub_server([ran, Answer(body=V1_ANSWER)]) as stub, pytest.raises(BlockgradError) as info:
        call(stub)
    assert len(stub.requests) == 1 and info.value.code == "deadline_exceeded"
    assert info.value.details == {"timeout_s": 1} and info.value.retry_after_s == 0


@pytest.mark.parametrize("answer", [error_answer(503, "device_out_of_memory"), error_answer(500, "internal_error"),
                                    error_answer(422, "validation_error", retry_after=None)])
def test_other_errors_are_not_retried(answer):
    with stub_server([answer, Answer(body=V1_ANSWER)]) as stub, pytest.raises(BlockgradError) as info:
        call(stub)
    assert len(stub.requests) == 1 and info.value.code == answer.headers["X-Blockgrad-Error-Code"]


def test_a_retry_after_past_the_deadline_is_not_waited_for():
    with stub_server([error_answer(503, "overloaded", retry_after="3600"), Answer(body=V1_ANSWER)]) as stub, \
            pytest.raises(BlockgradError) as info:
        call(stub, deadline_s=30)
    assert len(stub.requests) == 1 and info.value.retry_after_s == 3600


def test_a_connection_closed_before_any_answer_is_retried():
    with stub_server([Close(), Answer(body=V1_ANSWER)]) as stub:
        result = call(stub)
    assert len(stub.requests) == 2 and result.losses is None and result.bounds.tolist() == [0, 1]


@pytest.mark.parametrize("cut", [V1_ANSWER[:-2], None])  # without the closing "]}"; half the announced bytes
def test_an_answer_cut_short_is_incomplete_and_not_retried(cut):
    answer = Answer(body=cut) if cut else Answer(body=V1_ANSWER, cut=True)
    with stub_server([answer, Answer(body=V1_ANSWER)]) as stub, pytest.raises(BlockgradError) as info:
        call(stub)
    assert len(stub.requests) == 1 and (info.value.status, info.value.code) == (200, "incomplete_response")


def test_a_silent_server_is_a_timeout_and_not_retried():
    with stub_server([Stall(), Answer(body=V1_ANSWER)]) as stub:
        with pytest.raises(BlockgradError) as info:
            call(stub, timeout=0.2)
        # The stub's thread records the request, maybe after the client's 0.2 s: waited for.
        assert wait_until(lambda: stub.requests, 60), "the stub never read the request"
    assert len(stub.requests) == 1 and info.value.code == "timeout"


def test_one_connection_serves_successive_calls_with_the_token():
    with stub_server([Answer(body=V1_ANSWER)] * 3) as stub:
        with Client(stub.url, token="t0k") as client:
            for _ in range(3):
                client.gradients([[1.0]])
    ports = {port for _, _, port in stub.requests}
    assert len(stub.requests) == 3 and len(ports) == 1


def test_v2_error_body_and_header():
    body = json.dumps({"error": "Unknown parameters ['factr']"}).encode()
    answer = Answer(400, body, {"X-Blockgrad-Error-Code": "validation_error"})
    with stub_server([answer]) as stub, Client(stub.url) as client, pytest.raises(BlockgradError) as info:
        client.infer(np.zeros((1, 1), np.float32))
    assert (info.value.status, info.value.code, info.value.message) == (400, "validation_error", "Unknown parameters ['factr']")
    assert info.value.details == {}


# -- jobs: the app on a loopback server, its store in tmp_path, no cluster (jobs stay queued) ---
@pytest.fixture
def jobs_server(tmp_path):
    app = create_app({"BLOCKGRAD_DATA_DIR": str(tmp_path)})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", app
    finally:
        server.shutdown()
        thread.join(60)


def test_a_job_is_printed_cancelled_and_deleted(jobs_server):
    url, app = jobs_server
    with Client(url) as client:
        job = client.submit_job(vectors(8, 2, "float32"), factor=2)
        assert len(job.id) == 32 and repr(job) == str(job) == f"<Job {job.id} queued>"
        assert job.cancel()["status"] == "cancelled" and str(job) == f"<Job {job.id} cancelled>"
        assert job.cancel()["status"] == "cancelled"  # idempotent
        assert job.status() == "cancelled"  # cancelling forgets nothing
        job.delete()
        with pytest.raises(BlockgradError) as info:
            job.status()
        assert (info.value.status, info.value.code) == (404, "job_not_found")


def test_a_finished_job_cannot_be_cancelled_and_its_result_is_read(jobs_server):
    url, app = jobs_server
    accumulated = vectors(8, 2, "float64", seed=1)
    with Client(url) as client:
        job = client.submit_job(np.zeros((8, 2)), factor=2, dtype="float64", outputs=["accumulated"])
        engine = services_of(app).jobs.engine  # the runner's part, played here
        attempt = db.claim(engine, job.id, "runner", time.time(), 30.0, 3)
        assert db.finish_job(engine, job.id, "runner", attempt, time.time(), {"accumulated": accumulated}, None)
        with pytest.raises(BlockgradError) as info:
            job.cancel()
        assert (info.value.status, info.value.code, info.value.details) == (409, "job_done", {"status": "succeeded"})
        assert job.wait(timeout=60)["status"] == "succeeded"
        result = job.result()
        assert set(result) == {"accumulated", "bounds"} and result["bounds"].tolist() == [0, 4, 8]
        assert result["accumulated"].dtype == np.float64 and np.array_equal(result["accumulated"], accumulated)
        job.delete()
        with pytest.raises(BlockgradError) as info:
            job.result()
        assert info.value.code == "job_not_found"


# -- the codec and the package ----------------------------------------------------------------
def test_codec_constants_agree_with_the_server():
    from app.api.v2 import codec as server_codec, model

    assert codec.HEADER_LENGTH == server_codec.HEADER_LENGTH
    assert codec.BINARY_CONTENT_TYPE == server_codec.BINARY_CONTENT_TYPE
    assert (codec.MODEL_NAME, codec.INPUT_NAME) == (model.MODEL_NAME, model.INPUT_NAME)
    assert codec.OUTPUTS == tuple(model.OUTPUTS)
    assert codec.DATATYPE_OF_DTYPE == model.DATATYPE_OF_DTYPE


BLOCKED = ("torch", "flask", "werkzeug", "marshmallow", "orjson", "app", "gunicorn")
IMPORT_BLOCKED = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import numpy as np
import blockgrad_client
from blockgrad_client import Client, BlockgradError
from blockgrad_client.infer import binary_infer_request, read_infer_response
body, headers = binary_infer_request(np.ones((2, 3), np.float64), {{"factor": 1}})
assert headers["Content-Type"] == "application/octet-stream"
print(sorted(name.split(".")[0] for name in sys.modules if name.split(".")[0] in {BLOCKED!r}))
"""


def test_the_package_imports_without_torch_or_flask():
    done = subprocess.run([sys.executable, "-c", IMPORT_BLOCKED], cwd=CLIENT_DIR, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def requirement_names(requirements: list[str]) -> set[str]:
    import re
    return {re.split(r"[ <>=!~;\[]", line, maxsplit=1)[0].lower() for line in requirements}


def test_the_package_requires_numpy_requests_and_ijson_only(tmp_path):
    declared = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    assert requirement_names(declared) == {"numpy", "requests", "ijson"}
    # The built wheel's metadata is what `pip install ./client` resolves.
    source = tmp_path / "client"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, timeout=300, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("blockgrad_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith("/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in archive.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
        assert "blockgrad_client/client.py" in archive.namelist()
    assert requirement_names(requires) == {"numpy", "requests", "ijson"}
    assert blockgrad_client.__version__ in wheel.name


def test_a_compressed_answer_is_decompressed():
    import gzip

    answer = Answer(body=gzip.compress(V1_ANSWER), headers={"Content-Encoding": "gzip"})
    with stub_server([answer]) as stub:
        result = call(stub)
    assert result.accumulated.tolist() == [[4.0]] and len(result.blocks) == 1
