"""/v1/jobs' routes on the job store (app/jobs/store.py, app/jobs/db.py): SQLite in tmp_path,
and the same tests against a real PostgreSQL (tests/postgres.py's `postgres_url`). The web side
never talks to Dask: a job is accepted with no cluster at all, and its result is whatever the
store holds, written here by db.finish_job (as the runner writes it) from numbers made without
the service; the runner's own results (a real Dask cluster) are held to tests/oracle.py's
literal loops in the last tests."""
import io
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import requests

from app import create_app
from app.api.v1 import jobs as jobs_api
from app.extensions import services_of
from app.jobs import db
from tests.dask_cluster import threaded
from tests.events import HANG_S, answered
from tests.oracle import assert_matches_oracle, request_oracle
from tools.server import free_port, gunicorn_server, wait_until

HEX_ID = "0123456789abcdef" * 2
OWNER = "test-runner"  # the runner these tests play
NPZ = {"Accept": "application/x-npz"}
SMALL = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 3}


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/jobs.sqlite3"
    return request.getfixturevalue("postgres_url")  # a fresh database of a real server (tests/postgres.py)


def store_settings(store_url: str) -> dict:
    if store_url.startswith("sqlite"):
        return {"BLOCKGRAD_DATA_DIR": str(Path(store_url.removeprefix("sqlite:///")).parent)}
    return {"BLOCKGRAD_JOBS_DB": store_url}


def make_app(store_url: str, **settings):
    return create_app({"TESTING": True, **store_settings(store_url), **settings})


@pytest.fixture
def client(store_url):
    return make_app(store_url).test_client()


@pytest.fixture
def engine(store_url):
    engine = db.open_store(store_url)
    yield engine
    engine.dispose()


def npy(array: np.ndarray, **kwargs) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **kwargs)
    return buffer.getvalue()


def submit(client, body=SMALL, **kwargs) -> dict:
    response = client.post("/v1/jobs", json=body, **kwargs)
    assert response.status_code == 202, response.get_json()
    assert response.headers["Location"] == f"/v1/jobs/{response.get_json()['id']}"
    return response.get_json()


def finish(engine, job_id: str, arrays=None, error=None, now=None) -> None:
    """What the runner does with a job: claim it, then commit its outcome (fenced)."""
    now = time.time() if now is None else now
    attempt = db.claim(engine, job_id, OWNER, now, 30.0, 3)
    assert attempt is not None
    assert db.finish_job(engine, job_id, OWNER, attempt, now, arrays, error)


def error_of(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    error = response.get_json()["error"]
    assert error["code"] == code, error
    return error


def every_route(client, job_id: str) -> dict:
    return {"GET": client.get(f"/v1/jobs/{job_id}"), "result": client.get(f"/v1/jobs/{job_id}/result"),
            "cancel": client.post(f"/v1/jobs/{job_id}/cancel"), "DELETE": client.delete(f"/v1/jobs/{job_id}")}


def test_a_job_is_accepted_with_no_cluster_at_all_and_stays_queued(client, tmp_path):
    """No scheduler runs anywhere (BLOCKGRAD_DASK_SCHEDULER unset, no gunicorn to start one):
    the POST is 202 at once, the job queued with its input stored, as a .npy body too. The
    store is opened by the first job route, not when the app is made (gunicorn's master must
    not hold an engine that its workers inherit)."""
    assert not list(tmp_path.iterdir())
    record = submit(client)
    assert len(record["id"]) == 32 and int(record["id"], 16) >= 0  # 128 random bits, hex
    assert {key: record[key] for key in ("status", "n", "dim", "factor", "attempts", "progress", "started_at",
                                         "finished_at", "error")} == {
        "status": "queued", "n": 3, "dim": 2, "factor": 3, "attempts": 0,
        "progress": {"blocks_done": 0, "blocks_total": 9}, "started_at": None, "finished_at": None, "error": None}
    assert client.get(f"/v1/jobs/{record['id']}").get_json() == record
    waiting = error_of(client.get(f"/v1/jobs/{record['id']}/result"), 409, "job_not_done")
    assert waiting["details"] == {"status": "queued"}
    vectors = np.random.default_rng(7).standard_normal((50, 4))  # float64: the job's dtype
    response = client.post("/v1/jobs?factor=7&objective=sum_of_squares&outputs=accumulated", data=npy(vectors),
                           content_type="application/x-npy")
    assert response.status_code == 202, response.get_json()
    other = response.get_json()
    assert (other["status"], other["dtype"], other["outputs"], other["n"]) == ("queued", "float64", ["accumulated"], 50)
    stored = db.load_input(services_of(client.application).jobs.engine, other["id"])
    assert stored.dtype == np.float64 and np.array_equal(stored, vectors)  # what the runner will compute


def test_the_record_shows_the_runners_attempt(client, engine):
    job = submit(client)
    assert db.claim(engine, job["id"], OWNER, time.time(), 30.0, 3) == 1
    running = client.get(f"/v1/jobs/{job['id']}").get_json()
    assert (running["status"], running["attempts"]) == ("running", 1) and running["started_at"] is not None
    assert error_of(client.get(f"/v1/jobs/{job['id']}/result"), 409, "job_not_done")["details"] == {
        "status": "running"}


def test_cancel_is_idempotent_and_delete_forgets_on_every_route(client, engine):
    job = submit(client)
    db.claim(engine, job["id"], OWNER, time.time(), 30.0, 3)  # running
    first = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert first.status_code == 200, first.get_json()
    cancelled = first.get_json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 200 and again.get_json() == cancelled
    assert client.get(f"/v1/jobs/{job['id']}").get_json() == cancelled  # still there: cancel forgets nothing
    no_result = error_of(client.get(f"/v1/jobs/{job['id']}/result"), 409, "job_not_done")
    assert no_result["details"] == {"status": "cancelled"} and "error" not in no_result["message"]
    assert "Retry-After" not in client.get(f"/v1/jobs/{job['id']}/result").headers
    deleted = client.delete(f"/v1/jobs/{job['id']}")
    assert deleted.status_code == 204 and deleted.data == b""
    for route, response in every_route(client, job["id"]).items():
        assert error_of(response, 404, "job_not_found")["details"] == {"id": job["id"]}, route
    assert db.get_job(engine, job["id"]) is None and db.load_input(engine, job["id"]) is None


def test_a_queued_job_is_deleted_at_once(client, engine):
    job = submit(client)
    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert db.claimable(engine, time.time(), 10) == []  # no runner will start it


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_cancel_of_a_finished_job_is_409_job_done_and_changes_nothing(client, engine, outcome):
    job = submit(client)
    arrays = {"accumulated": np.ones((3, 2), np.float32), "losses": np.ones((3, 3), np.float32)}
    error = {"code": "non_finite_result", "message": "overflow", "details": {}}
    finish(engine, job["id"], *((arrays, None) if outcome == "succeeded" else (None, error)))
    before = client.get(f"/v1/jobs/{job['id']}").get_json()
    refused = error_of(client.post(f"/v1/jobs/{job['id']}/cancel"), 409, "job_done")
    assert refused["details"] == {"status": outcome}
    assert client.get(f"/v1/jobs/{job['id']}").get_json() == before
    assert before["status"] == outcome and before["error"] == (None if outcome == "succeeded" else error)
    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204


def test_unknown_ids_are_404_on_every_route(client):
    for job_id in (HEX_ID, "not-an-id", "1", HEX_ID.upper()):
        for route, response in every_route(client, job_id).items():
            assert response.status_code == 404, (job_id, route)
            assert response.get_json()["error"]["code"] == "job_not_found", (job_id, route)


def test_an_idempotency_key_gives_the_same_job(client, engine):
    first = submit(client, headers={"Idempotency-Key": "retry-me"})
    again = client.post("/v1/jobs", json=SMALL, headers={"Idempotency-Key": "retry-me"})
    assert again.status_code == 202 and again.get_json() == first
    other = submit(client)
    assert other["id"] != first["id"]
    assert db.status_counts(engine)["queued"] == 2


@pytest.mark.parametrize("changed", [
    {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]]}, {"factor": 1}, {"objective": "mean"},
    {"offset": 2.0}, {"dtype": "float64"}, {"outputs": ["losses"]}])
def test_a_key_reused_with_another_request_is_422_and_makes_nothing(client, engine, changed):
    first = submit(client, headers={"Idempotency-Key": "mine"})
    refused = client.post("/v1/jobs", json={**SMALL, **changed}, headers={"Idempotency-Key": "mine"})
    error = error_of(refused, 422, "idempotency_key_reused")
    assert "Idempotency-Key" in error["message"] and error["details"] == {"header": "Idempotency-Key"}
    assert db.status_counts(engine)["queued"] == 1
    again = client.post("/v1/jobs", json=SMALL, headers={"Idempotency-Key": "mine"})
    assert again.status_code == 202 and again.get_json() == first


def test_the_same_request_as_npy_is_the_same_request(client):
    """The hash is of the job's vectors and fields, not of the body's bytes."""
    first = submit(client, headers={"Idempotency-Key": "either"})
    again = client.post("/v1/jobs?factor=3", data=npy(np.array(SMALL["vectors"], np.float32)),
                        content_type="application/x-npy", headers={"Idempotency-Key": "either"})
    assert again.status_code == 202 and again.get_json()["id"] == first["id"]


@pytest.mark.parametrize("alike", [True, False])
def test_concurrent_posts_with_one_key_make_one_job(store_url, engine, alike):
    """Each thread its own app and connection, all released at once: one job; with different
    bodies (each its own offset), every POST but the one that made it 422."""
    count = 6
    clients = [make_app(store_url).test_client() for _ in range(count)]
    start, answers = threading.Barrier(count), []

    def post(own, number):
        start.wait(timeout=60)
        body = SMALL if alike else {**SMALL, "offset": float(number)}
        answers.append(own.post("/v1/jobs", json=body, headers={"Idempotency-Key": "together"}))
    threads = [threading.Thread(target=post, args=pair) for pair in zip(clients, range(count))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    assert len(answers) == count and db.status_counts(engine)["queued"] == 1
    statuses = sorted(a.status_code for a in answers)
    assert statuses == ([202] * count if alike else [202] + [422] * (count - 1)), [a.get_json() for a in answers]
    assert len({a.get_json()["id"] for a in answers if a.status_code == 202}) == 1
    assert {a.get_json()["error"]["code"] for a in answers if a.status_code == 422} <= {"idempotency_key_reused"}


def test_max_jobs_counts_the_queued_and_running_jobs(store_url):
    client = make_app(store_url, BLOCKGRAD_MAX_JOBS="1").test_client()
    job = submit(client)
    refused = client.post("/v1/jobs", json=SMALL)
    error = error_of(refused, 503, "overloaded")
    assert error["details"]["limit"] == "BLOCKGRAD_MAX_JOBS" and refused.headers["Retry-After"]
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200  # no longer active
    submit(client)


def test_a_job_finished_past_its_ttl_is_404_at_once(store_url, engine):
    """No sweep has run (its rows are still in the store): read past BLOCKGRAD_JOB_TTL_S, it is gone."""
    client = make_app(store_url, BLOCKGRAD_JOB_TTL_S="3600").test_client()
    arrays = {"accumulated": np.zeros((3, 2), np.float32), "losses": np.zeros((3, 3), np.float32)}
    old, fresh = submit(client), submit(client)
    finish(engine, old["id"], arrays, now=time.time() - 3601)
    finish(engine, fresh["id"], arrays)
    for route, response in every_route(client, old["id"]).items():
        assert response.status_code == 404 and response.get_json()["error"]["code"] == "job_not_found", route
    assert db.get_job(engine, old["id"]) is not None  # 404 by its age alone
    assert client.get(f"/v1/jobs/{fresh['id']}/result").status_code == 200


def expected_json(record: dict, arrays: dict) -> bytes:
    """Today's whole answer, written at once by orjson: the bytes the stream must send."""
    n, f = record["n"], record["factor"]
    bounds = [k * (n // f) for k in range(f)] + [n]
    head = {"n": n, "dim": record["dim"], "factor": f, "bounds": bounds, "objective": record["objective"],
            "dtype": record["dtype"], "device": "cpu"}
    return orjson.dumps({**head, **{name: arrays[name] for name in record["outputs"]}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.parametrize("dtype, outputs", [("float32", ["accumulated", "losses"]), ("float64", ["losses"]),
                                            ("float64", ["accumulated"])])
def test_a_stored_result_streams_as_json_and_npz_chunk_by_chunk(client, engine, monkeypatch, dtype, outputs):
    """Results of several stored chunks each (small chunks here): the JSON is byte for byte the
    document today's route wrote at once, the .npz has the same arrays (np.load reads it), and
    each is produced while it is read: the first piece is out before most chunks are read."""
    n, dim, factor = 40, 3, 6
    rng = np.random.default_rng(3)
    arrays = {"accumulated": rng.standard_normal((n, dim)).astype(dtype),
              "losses": (rng.standard_normal((factor, factor)) * 1e30).astype(dtype)}
    arrays["accumulated"][0, :] = [np.finfo(dtype).smallest_subnormal, -0.0, np.finfo(dtype).max]
    body = {"vectors": np.zeros((n, dim)).tolist(), "factor": factor, "dtype": dtype, "outputs": outputs}
    job = submit(client, body)
    monkeypatch.setattr(db, "RESULT_CHUNK_BYTES", 64)  # whole rows: 2 to 8 of them per stored chunk
    monkeypatch.setattr(jobs_api, "PIECE_BYTES", 24)  # each sent in pieces of 1 to 3 rows
    finish(engine, job["id"], {name: arrays[name] for name in outputs})
    chunks = sum(-(-len(arrays[name]) // max(1, 64 // arrays[name][:1].nbytes)) for name in outputs)
    reads = []
    real = db.result_chunk
    monkeypatch.setattr(db, "result_chunk", lambda *args: reads.append(args[-1]) or real(*args))
    url = f"/v1/jobs/{job['id']}/result"
    for headers in ({}, NPZ):
        reads.clear()
        streamed = client.get(url, headers=headers, buffered=False)
        assert streamed.status_code == 200 and streamed.is_streamed
        pieces = iter(streamed.response)
        first = next(pieces)
        assert first and len(reads) <= 2 < chunks  # one chunk read, not the result
        data = first + b"".join(pieces)
        streamed.close()
        assert len(reads) == chunks + len(outputs)  # each chunk once, and one read past each output's last
        if headers:
            assert streamed.mimetype == "application/x-npz"
            with np.load(io.BytesIO(data), allow_pickle=False) as got:
                assert got.files == ["bounds", *outputs]
                assert got["bounds"].tolist() == [0, 6, 12, 18, 24, 30, 40]
                for name in outputs:
                    assert got[name].dtype == dtype and np.array_equal(got[name], arrays[name]), name
        else:
            assert streamed.mimetype == "application/json"
            assert data == expected_json(job, arrays)


def test_a_result_deleted_while_it_streams_is_cut_not_completed(client, engine, monkeypatch):
    job = submit(client, {"vectors": np.zeros((40, 3)).tolist(), "factor": 4, "outputs": ["accumulated"]})
    monkeypatch.setattr(db, "RESULT_CHUNK_BYTES", 64)
    finish(engine, job["id"], {"accumulated": np.ones((40, 3), np.float32)})
    streamed = client.get(f"/v1/jobs/{job['id']}/result", buffered=False)
    pieces = iter(streamed.response)
    next(pieces)
    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204
    with pytest.raises(Exception, match="There is no job"):
        b"".join(pieces)
    streamed.close()


def test_a_download_reserves_a_chunks_worth_of_memory_whatever_the_results_size(client, engine):
    """In the worker's ledger while the body streams: the same bytes for a result 100x larger,
    given back at its end; a ledger that cannot hold them is 503 overloaded."""
    ledger = services_of(client.application).ledger
    held_bytes = []
    for n in (40, 4000):
        job = submit(client, {"vectors": np.zeros((n, 2)).tolist(), "factor": 4, "outputs": ["accumulated"]})
        finish(engine, job["id"], {"accumulated": np.ones((n, 2), np.float32)})
        streamed = client.get(f"/v1/jobs/{job['id']}/result", buffered=False)
        next(iter(streamed.response))
        held_bytes.append(ledger.reserved)
        streamed.close()
        assert ledger.reserved == 0
    assert held_bytes[0] == held_bytes[1] > 0
    other = ledger.reserve(ledger.budget - held_bytes[0] + 1)  # another request's
    try:
        busy = client.get(f"/v1/jobs/{job['id']}/result")
        assert error_of(busy, 503, "overloaded") and busy.headers["Retry-After"]
    finally:
        other.release()


def test_without_jobs_every_job_route_is_cluster_unavailable(tmp_path):
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": "off",
                         "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    for response in (client.post("/v1/jobs", json=SMALL), *every_route(client, HEX_ID).values()):
        assert error_of(response, 503, "cluster_unavailable") and response.headers["Retry-After"]
    assert client.get("/readyz").get_json()["cluster"] == {"store": None, "reachable": False, "workers": 0}
    assert not list(tmp_path.iterdir())  # no store opened



def test_a_store_that_does_not_answer_is_503_store_unavailable_and_v1_unaffected(dead_postgres_url):
    """Every job route answers (the store's own timeouts bound it: db.py), 503 with Retry-After;
    /v1/gradients, /readyz and /metrics answer as ever."""
    client = create_app({"TESTING": True, "BLOCKGRAD_JOBS_DB": dead_postgres_url}).test_client()
    calls = [lambda: client.post("/v1/jobs", json=SMALL), lambda: client.get(f"/v1/jobs/{HEX_ID}"),
             lambda: client.get(f"/v1/jobs/{HEX_ID}/result"), lambda: client.post(f"/v1/jobs/{HEX_ID}/cancel"),
             lambda: client.delete(f"/v1/jobs/{HEX_ID}")]
    for call in calls:
        response = answered(call)
        assert error_of(response, 503, "store_unavailable") and int(response.headers["Retry-After"]) >= 1
        assert client.post("/v1/gradients", json={"vectors": [[1.0], [2.0]]}).status_code == 200
    assert client.get("/readyz").get_json()["cluster"] == {"store": "postgresql", "reachable": False, "workers": 0}
    assert answered(lambda: client.get("/metrics")).status_code == 200


def test_blocks_are_refused_with_the_reason(client):
    response = client.post("/v1/jobs", json={"vectors": [[1.0]], "outputs": ["blocks", "losses"]})
    error = error_of(response, 422, "validation_error")
    assert "N x N x 2D" in str(error["details"]["fields"]["outputs"])
    response = client.post("/v1/jobs?outputs=blocks", data=npy(np.ones((2, 2))), content_type="application/x-npy")
    assert response.status_code == 422 and "N x N x 2D" in str(response.get_json()["error"]["details"])


@pytest.mark.parametrize("body, status, words", [
    (npy(np.array([{"a": 1}, None], dtype=object), allow_pickle=True), 422, "pickle"),
    (npy(np.ones(5)), 422, "shape"),
    (npy(np.ones((2, 3, 4))), 422, "shape"),
    (npy(np.ones((3, 2), dtype=np.int64)), 422, "float32 or float64"),
    (npy(np.ones((64, 8)))[:-17], 400, "npy"),  # truncated
    (b"\x93NUMPY", 400, "npy"),
    (pickle.dumps(np.ones((2, 2))), 400, "npy"),  # a pickle, not a .npy
    (npy(np.array([[1.0, np.nan]])), 422, "not a finite number"),
])
def test_bad_npy_bodies_are_clear_4xx(tmp_path, body, status, words):
    client = create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    response = client.post("/v1/jobs", data=body, content_type="application/x-npy")
    assert response.status_code == status, response.get_json()
    assert words in str(response.get_json()["error"]).lower() or words in str(response.get_json()["error"])


def test_npy_query_fields_follow_v1s_rules(tmp_path):
    client = create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    data = npy(np.ones((4, 2), dtype=np.float32))
    for query, field in (("factor=9", "factor"), ("factor=x", "factor"), ("dtype=float64", "dtype"),
                         ("objective=nope", "objective"), ("outputs=", "outputs"), ("colour=red", "colour")):
        response = client.post(f"/v1/jobs?{query}", data=data, content_type="application/x-npy")
        assert response.status_code == 422, query
        assert field in response.get_json()["error"]["details"]["fields"], query


def test_job_limits_are_their_own(tmp_path):
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_JOB_N": "16", "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS": "64",
                         "BLOCKGRAD_MAX_JOB_BODY_BYTES": "1024", "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    too_many = client.post("/v1/jobs", json={"vectors": [[1.0]] * 17})
    assert error_of(too_many, 413, "limit_exceeded")["details"]["limit"] == "BLOCKGRAD_MAX_JOB_N"
    big_block = client.post("/v1/jobs", json={"vectors": [[1.0, 2.0]] * 16, "factor": 2})  # 8 x 8 x 4 = 256
    details = error_of(big_block, 413, "limit_exceeded")["details"]
    assert details["limit"] == "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS"
    side = -(-16 // details["suggested_factor"])
    assert side * side * 4 <= 64  # the suggested factor fits
    body = client.post("/v1/jobs", data=npy(np.ones((16, 16))), content_type="application/x-npy")
    assert error_of(body, 413, "too_large")["details"]["limit"] == "BLOCKGRAD_MAX_JOB_BODY_BYTES"
    # N over BLOCKGRAD_MAX_N is a synchronous limit only: a job of N = 9 is accepted.
    open_client = create_app({"TESTING": True, "BLOCKGRAD_MAX_N": "8", "BLOCKGRAD_DATA_DIR": str(tmp_path)})
    submit(open_client.test_client(), {"vectors": [[1.0]] * 9})


@pytest.mark.slow
def test_gunicorn_accepts_jobs_while_no_scheduler_answers(postgres_url):
    """The server users run (tools/server.py: gunicorn -c gunicorn.conf.py) on a PostgreSQL store
    with an external scheduler nobody listens on: the very first POST is 202 (no retry), the
    job stays queued, and cancel, DELETE and /v1/gradients answer as ever."""
    scheduler = f"tcp://127.0.0.1:{free_port()}"
    env = {"BLOCKGRAD_DASK_SCHEDULER": scheduler, "BLOCKGRAD_JOBS_DB": postgres_url}
    with gunicorn_server(workers=1, env=env) as server:
        posted = requests.post(server.url + "/v1/jobs", json=SMALL, timeout=HANG_S)
        assert posted.status_code == 202, posted.text
        job = f"{server.url}/v1/jobs/{posted.json()['id']}"
        record = requests.get(job, timeout=HANG_S).json()
        assert (record["status"], record["attempts"]) == ("queued", 0), record
        ready = requests.get(server.url + "/readyz", timeout=HANG_S)
        assert ready.json()["cluster"] == {"store": "postgresql", "reachable": False, "workers": 0}
        assert scheduler.split("//")[1] not in ready.text  # never where
        cancelled = requests.post(job + "/cancel", timeout=HANG_S)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert requests.delete(job, timeout=HANG_S).status_code == 204
        assert requests.get(job + "/result", timeout=HANG_S).status_code == 404
        assert requests.post(server.url + "/v1/gradients", json=SMALL, timeout=HANG_S).status_code == 200


# -- computed by the runner on a real local Dask cluster ------------------------------------------
COMPUTED = [
    {"vectors": np.random.default_rng(40).standard_normal((40, 3)).round(3).tolist(), "factor": 6,
     "objective": "sum", "dtype": "float32", "outputs": ["accumulated", "losses"]},  # 40 = 6 * 6 + 4
    {"vectors": np.random.default_rng(33).standard_normal((33, 2)).tolist(), "factor": 5,
     "objective": "logsumexp", "dtype": "float64", "outputs": ["accumulated", "losses"]},
    # The amplifying shape (D = 1, factor = N), with each output alone.
    {"vectors": np.random.default_rng(36).standard_normal((36, 1)).tolist(), "factor": 36,
     "objective": "sum_of_squares", "dtype": "float64", "outputs": ["accumulated"]},
    {"vectors": np.random.default_rng(35).standard_normal((35, 1)).tolist(), "factor": 35,
     "objective": "sum_of_squares", "dtype": "float32", "outputs": ["losses"]},
]


def count_results_through_the_scheduler(dask_scheduler) -> None:
    """Run on the scheduler: its gather and scatter handlers (data passing through it) counted."""
    import functools

    counts = dask_scheduler.blockgrad_counts = {"gather": 0, "scatter": 0}

    def counting(op, real):
        @functools.wraps(real)
        def counted(*args, **kwargs):
            counts[op] += 1
            return real(*args, **kwargs)
        return counted
    for op in counts:
        dask_scheduler.handlers[op] = counting(op, dask_scheduler.handlers[op])


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_jobs_the_runner_computed_are_exact_against_the_literal_loops(request, store_url):
    """POST, then the runner (a thread here, on a real local cluster) computes and stores; the
    streamed JSON and .npz both match tests/oracle.py's long-double loops, with only the outputs
    asked for; no input or outcome passed through the scheduler (the runner's Client talks to
    the workers directly), which a plain Client's gather does."""
    from distributed import Client

    runner = pytest.importorskip("app.jobs.runner", reason="the job runner (jrun's branch) is not merged yet")
    cluster = request.getfixturevalue("cluster")
    app = make_app(store_url)
    client, served = app.test_client(), services_of(app)
    jobs = [submit(client, body) for body in COMPUTED]
    spy = Client(cluster.address, set_as_default=False)
    spy.run_on_scheduler(count_results_through_the_scheduler)
    running = threaded(runner.Runner(served.jobs.settings, served.objectives, db.open_store(store_url), cluster.address))
    try:
        for body, job in zip(COMPUTED, jobs, strict=True):
            records = []

            def finished():
                records.append(client.get(f"/v1/jobs/{job['id']}").get_json())
                return records[-1]["status"] not in ("queued", "running")
            assert wait_until(finished, 120, 0.2), records[-1]
            assert records[-1]["status"] == "succeeded" and records[-1]["attempts"] == 1, records[-1]
            o = request_oracle(body)
            assert_matches_oracle(body, client.get(f"/v1/jobs/{job['id']}/result").get_json(), o)
            with np.load(io.BytesIO(client.get(f"/v1/jobs/{job['id']}/result", headers=NPZ).data)) as got:
                as_body = {"n": len(body["vectors"]), "dim": len(body["vectors"][0]), "factor": body["factor"],
                           "bounds": got["bounds"].tolist(), "objective": body["objective"], "dtype": body["dtype"],
                           "device": "cpu", **{name: got[name] for name in body["outputs"]}}
            assert_matches_oracle(body, as_body, o)
        assert spy.run_on_scheduler(lambda dask_scheduler: dask_scheduler.blockgrad_counts) == {"gather": 0,
                                                                                               "scatter": 0}
        spy.gather(spy.submit(sum, [1, 2]), direct=False)  # the counter counts
        assert spy.run_on_scheduler(lambda dask_scheduler: dask_scheduler.blockgrad_counts)["gather"] == 1
    finally:
        running.stop()
        spy.close()
