"""POST /v1/jobs under hostile input (issue 30): a .npy header that lies about its body's size,
and BLOCKGRAD_MAX_JOBS under a flood of concurrent POSTs on the server users run."""
import io
import threading
import tracemalloc

import numpy as np
import pytest
import requests

from tests.events import HANG_S
from tests.test_jobs import SMALL, make_app, npy
from tools.server import free_port, gunicorn_server

NPY = "application/x-npy"
HUGE_SHAPE = (10**10, 1)  # float64: 80 GB declared


def lying_npy(shape: tuple[int, ...], data: bytes, dtype: str = "<f8") -> bytes:
    """numpy.save's header for `shape`, followed by `data` whatever its size."""
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    with io.BytesIO() as buffer:
        np.lib.format.write_array_header_1_0(buffer, header)
        return buffer.getvalue() + data


def assert_sizes_named(response, declared: int, sent: int) -> None:
    body = response.json() if callable(response.json) else response.json
    assert response.status_code == 400, body
    assert body["error"]["code"] == "bad_request", body
    assert body["error"]["details"] == {"declared_bytes": declared, "body_bytes": sent}, body
    assert str(declared) in body["error"]["message"] and str(sent) in body["error"]["message"], body


@pytest.fixture
def client(tmp_path):
    return make_app(f"sqlite:///{tmp_path}/jobs.sqlite3").test_client()


def test_a_header_declaring_more_than_its_body_is_400_before_anything_is_allocated(client):
    body = lying_npy(HUGE_SHAPE, bytes(64))
    assert len(body) < 256  # the issue's ~192-byte body
    tracemalloc.start()
    try:
        response = client.post("/v1/jobs", data=body, content_type=NPY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_sizes_named(response, 8 * 10**10, 64)
    assert peak < 64 * 2**20, f"{peak} bytes allocated while refusing it"


def test_a_header_declaring_less_than_its_body_is_400(client):
    assert_sizes_named(client.post("/v1/jobs", data=lying_npy((2, 2), bytes(8 * 5)), content_type=NPY), 32, 40)


def test_a_truthful_npy_is_still_202(client):
    response = client.post("/v1/jobs?factor=2", data=npy(np.ones((4, 3))), content_type=NPY)
    assert response.status_code == 202, response.get_json()
    assert (response.get_json()["n"], response.get_json()["dim"]) == (4, 3)


@pytest.mark.slow
def test_the_lying_header_on_the_server_users_run(served):
    response = requests.post(served.url + "/v1/jobs", data=lying_npy(HUGE_SHAPE, bytes(64)),
                             headers={"Content-Type": NPY}, timeout=HANG_S)
    assert_sizes_named(response, 8 * 10**10, 64)


FLOOD = 40
MAX_JOBS = 16  # BLOCKGRAD_MAX_JOBS' default: not set below


@pytest.mark.slow
def test_max_jobs_holds_under_40_concurrent_posts(postgres_url):
    """gunicorn as `make serve` starts it, on a PostgreSQL store, with an external scheduler
    nobody listens on (every job stays queued): 40 POSTs, each on its own connection, released
    together; exactly 16 are accepted (nothing else was queued), every other is 503 overloaded
    with Retry-After."""
    env = {"BLOCKGRAD_DASK_SCHEDULER": f"tcp://127.0.0.1:{free_port()}", "BLOCKGRAD_JOBS_DB": postgres_url}
    with gunicorn_server(workers=None, env=env) as server:
        barrier, answers = threading.Barrier(FLOOD), [None] * FLOOD

        def post(index: int) -> None:
            with requests.Session() as session:  # its own connection
                barrier.wait(timeout=HANG_S)
                answers[index] = session.post(server.url + "/v1/jobs", json=SMALL, timeout=HANG_S)

        threads = [threading.Thread(target=post, args=(index,)) for index in range(FLOOD)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_S)
        assert all(answer is not None for answer in answers), "a POST got no answer"
        codes = [answer.status_code for answer in answers]
        assert codes.count(202) == MAX_JOBS, codes
        for answer in answers:
            if answer.status_code != 202:
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "overloaded", answer.text
                assert int(answer.headers["Retry-After"]) > 0, answer.headers
