"""/v1/jobs against a real local Dask cluster (app/jobs/cluster.py's embedded one: a
scheduler and two single-threaded workers on 127.0.0.1), started once for the module and
stopped after it. Numbers are compared with /v1/gradients' answer and tools/reference.py."""
import dataclasses
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from app import create_app
from app.extensions import services_of
from app.jobs import client as jobs_client
from app.jobs.client import close_clients, cluster_client
from app.jobs.cluster import free_port, start_embedded, stop_embedded
from app.jobs.metrics import observe_workers
from app.jobs.on_scheduler import JOBS, forget_records, snapshots
from tests.dask_cluster import (CLUSTER_START_S, JOB_S, TILE, TILE_BLOCKS, TILE_DIM, TILE_FACTOR, TILE_N, HeldTiles,
                                dask_role, input_copies, npy, task_runs, tile_faults, tile_job, wait_for_job,
                                wait_for_workers)
from tests.numeric import assert_matches
from tools.reference import reference_accumulated, reference_blocks
from tools.server import children, wait_until

ROOT = Path(__file__).resolve().parent.parent
HEX_ID = "0123456789abcdef" * 2
# /v1 computed here with one thread, as every Dask task
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def quiet_cluster():
    """A cluster of one worker for the tests that count every job on the scheduler: each of
    them leaves no job queued or running, so none waits on another test's jobs."""
    own = start_embedded(1)
    try:
        wait_for_workers(own.address, 1)
        yield own
    finally:
        close_clients(own.address)
        stop_embedded(own)


def assert_nothing_active(address: str) -> None:
    dask = cluster_client(address)
    active = {job_id: s for job_id, s in dask.run_on_scheduler(snapshots, None).items()
              if s["outcome"] is None and not s["record"].get("cancelled")}
    assert not active, f"jobs another test left running: {active}"


@pytest.fixture(scope="module")
def jobs_app(cluster):
    return create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address})


@pytest.fixture
def client(jobs_app):
    return jobs_app.test_client()


def submit(client, **body):
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.get_json()
    return response


def reference_losses(vectors: np.ndarray, factor: int, objective: str, dtype: str) -> np.ndarray:
    v = torch.tensor(vectors, dtype=getattr(torch, dtype))
    losses = [float(loss) for loss, _ in reference_blocks(v, factor, objective)]
    return np.array(losses).reshape(factor, factor)


@pytest.mark.parametrize("n, dim, factor, objective, dtype", [
    (40, 3, 6, "sum", "float32"),  # 40 = 6 * 6 + 4: a larger last block row and column
    (33, 2, 5, "logsumexp", "float64"),
])
def test_json_job_equals_v1_and_the_reference(client, n, dim, factor, objective, dtype):
    vectors = np.random.default_rng(n).standard_normal((n, dim)).round(3)
    body = {"vectors": vectors.tolist(), "factor": factor, "objective": objective, "dtype": dtype}
    response = submit(client, **body)
    record = response.get_json()
    assert response.headers["Location"] == f"/v1/jobs/{record['id']}"
    assert len(record["id"]) == 32 and int(record["id"], 16) >= 0  # 128 random bits, hex
    assert record["outputs"] == ["accumulated", "losses"] and record["progress"]["blocks_total"] == factor ** 2
    done = wait_for_job(client, record["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"] == {"blocks_done": factor ** 2, "blocks_total": factor ** 2}
    assert done["created_at"] <= done["started_at"] <= done["finished_at"] and done["error"] is None
    result = client.get(f"/v1/jobs/{record['id']}/result")
    assert result.status_code == 200
    job = result.get_json()
    sync = client.post("/v1/gradients", json={**body, "outputs": ["accumulated", "losses"]}).get_json()
    for key in ("n", "dim", "factor", "bounds", "objective", "dtype", "device"):
        assert job[key] == sync[key], key
    assert job["losses"] == sync["losses"]  # the same digits: the same bits
    assert_matches(job["accumulated"], sync["accumulated"], dtype)
    v = torch.tensor(vectors, dtype=getattr(torch, dtype))
    assert_matches(job["accumulated"], reference_accumulated(v, factor, objective).numpy(), dtype)
    assert_matches(job["losses"], reference_losses(vectors, factor, objective, dtype), dtype)


def test_npy_job_with_query_fields_and_an_npz_result(client):
    vectors = np.random.default_rng(7).standard_normal((50, 4))  # float64: the job's dtype
    response = client.post("/v1/jobs?factor=7&objective=sum_of_squares&outputs=accumulated",
                           data=npy(vectors), content_type="application/x-npy")
    assert response.status_code == 202, response.get_json()
    record = response.get_json()
    assert (record["dtype"], record["outputs"], record["n"], record["dim"]) == ("float64", ["accumulated"], 50, 4)
    assert wait_for_job(client, record["id"])["status"] == "succeeded"
    binary = client.get(f"/v1/jobs/{record['id']}/result", headers={"Accept": "application/x-npz"})
    assert binary.status_code == 200 and binary.mimetype == "application/x-npz"
    arrays = np.load(io.BytesIO(binary.data), allow_pickle=False)
    assert set(arrays.files) == {"accumulated", "bounds"}
    expected = reference_accumulated(torch.tensor(vectors), 7, "sum_of_squares").numpy()
    assert arrays["accumulated"].dtype == np.float64
    assert_matches(arrays["accumulated"], expected, "float64")
    assert arrays["bounds"].tolist() == [0, 7, 14, 21, 28, 35, 42, 50]
    for accept in ("*/*", "application/*", "application/json"):  # only the exact type gets binary
        assert client.get(f"/v1/jobs/{record['id']}/result", headers={"Accept": accept}).mimetype == "application/json"
    assert client.delete(f"/v1/jobs/{record['id']}").status_code == 204  # finished: forgotten
    assert client.get(f"/v1/jobs/{record['id']}").status_code == 404


def test_unknown_ids_are_404(client):
    for job_id in (HEX_ID, "not-an-id", "1", HEX_ID.upper()):
        for method, path in (("get", ""), ("get", "/result"), ("delete", "")):
            response = getattr(client, method)(f"/v1/jobs/{job_id}{path}")
            assert response.status_code == 404, (job_id, path)
            assert response.get_json()["error"]["code"] == "job_not_found"


def test_idempotency_key_returns_the_same_job(client):
    body = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 3}
    first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "retry-me"}).get_json()
    again = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "retry-me"}).get_json()
    other = client.post("/v1/jobs", json=body).get_json()
    assert first["id"] == again["id"] != other["id"]
    for job_id in (first["id"], other["id"]):
        assert wait_for_job(client, job_id)["status"] == "succeeded"


def test_readyz_and_metrics_report_the_cluster(client):
    job = submit(client, vectors=[[1.0], [2.0]], factor=2).get_json()  # connects this process
    assert wait_for_job(client, job["id"])["status"] == "succeeded"  # a succeeded job of its own to count
    reports = []

    def both_workers_seen():  # the Client's own view, refreshed every few seconds
        reports.append(client.get("/readyz").get_json()["cluster"])
        return reports[-1]["connected"] is True and reports[-1]["workers"] == 2
    assert wait_until(both_workers_seen, 30, 0.5), reports[-1]
    metrics = client.get("/metrics").get_data(as_text=True)
    assert "blockgrad_cluster_workers 2.0" in metrics
    assert 'blockgrad_job_events_total{event="submitted"}' in metrics
    assert 'blockgrad_jobs{status="succeeded"}' in metrics


def scraped_gauges(client) -> dict[str, float]:
    """/metrics' job gauges: status -> blockgrad_jobs, and "workers"."""
    found = {}
    for family in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True)):
        for sample in family.samples:
            if sample.name == "blockgrad_jobs":
                found[sample.labels["status"]] = sample.value
            elif sample.name == "blockgrad_cluster_workers":
                found["workers"] = sample.value
    return found


def test_the_job_gauges_are_read_when_scraped_not_at_the_last_post(quiet_cluster):
    """A job that finished, then one forgotten, after the last POST: each scrape counts what the
    scheduler holds then."""
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": quiet_cluster.address}).test_client()
    assert_nothing_active(quiet_cluster.address)
    before = scraped_gauges(client)
    assert before["queued"] == before["running"] == 0, before
    job = submit(client, vectors=[[1.0, 2.0], [3.0, 4.0]], factor=2).get_json()  # the last POST
    assert wait_for_job(client, job["id"])["status"] == "succeeded"
    after = scraped_gauges(client)
    assert after == {**before, "succeeded": before["succeeded"] + 1, "queued": 0, "running": 0, "workers": 1}
    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204  # forgotten: one succeeded job fewer
    assert scraped_gauges(client) == {**after, "succeeded": after["succeeded"] - 1}


HANG_S = 120  # far above any answer's bound: reached only by a call that hangs


def answered(call):
    """call()'s value, failing the test if it has not returned after HANG_S (a hang)."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert outcome, f"no answer after {HANG_S} s: hung"
    return outcome[0]


def test_a_scrape_with_the_scheduler_unreachable_is_bounded_and_reports_no_workers():
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": f"tcp://127.0.0.1:{free_port()}"}).test_client()
    observe_workers(2)  # what an earlier read saw
    gauges = answered(lambda: scraped_gauges(client))  # METRICS_READ_S bounds it: no hang
    assert gauges["workers"] == 0


TILE_PAIR_PAGES = TILE_BLOCKS * (TILE_N // TILE_FACTOR) ** 2 * 2 * TILE_DIM * 4 // os.sysconf("SC_PAGE_SIZE")
# The unfixed case (MALLOC_TRIM_THRESHOLD_=65536, no restore), measured on 2026-12-01 in a
# process of its own: 163,953 to 164,362 faults a tile, 5.0x TILE_PAIR_PAGES (32,768), every
# chunk's tensors mapped afresh. Fixed, the fewest of three: 1 to 6,176 (a single tile up to
# 22,528). The bound is half the unfixed figure: 2x below it, 13x above the fixed case seen.
UNFIXED_FAULTS = 5 * TILE_PAIR_PAGES
FAULTS_BOUND = UNFIXED_FAULTS // 2


def test_the_embedded_workers_start_without_the_nannys_trim_threshold(cluster):
    """A Dask nanny's MALLOC_TRIM_THRESHOLD_ would make every chunk's tensors fresh mmaps, each
    page zeroed by the kernel on first touch (docs/jobs.md, "Throughput"): the embedded
    nannies leave it out (cluster.NANNY_ENVIRON) and keep distributed's one-thread settings.
    Counted, not timed: the minor page faults of one tile on one worker, the fewest of three
    (the first ones warm its heap up), against the pages of the tile's pairs alone; without
    the reuse every chunk maps all its tensors afresh (UNFIXED_FAULTS)."""
    dask = cluster_client(cluster.address)
    worker = sorted(dask.scheduler_info()["workers"])[0]
    names = ("MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    assert dask.run(lambda: [os.environ.get(name) for name in names], workers=[worker]) == {
        worker: [None, "1", "1", "1"]}
    vectors, spec = tile_job()
    faults = [dask.submit(tile_faults, vectors, spec, *TILE, workers=[worker], pure=False)
              .result(timeout=JOB_S) for _ in range(3)]
    assert min(faults) < FAULTS_BOUND, (faults, FAULTS_BOUND)  # the margins: beside FAULTS_BOUND


def test_a_tile_reuses_freed_memory_under_distributeds_default_trim_threshold():
    """An external `dask worker` with distributed's defaults starts with MALLOC_TRIM_THRESHOLD_=65536:
    its first tile task restores glibc's reuse (tasks.restore_malloc_reuse). Here in a process
    of its own started so; without the restore every tile maps about 5x its pairs' pages."""
    program = ("import torch\n"
               "from tests.dask_cluster import TILE, tile_faults, tile_job\n"
               "torch.set_num_threads(1)  # as on a worker\n"
               "vectors, spec = tile_job()\n"
               "print(min(tile_faults(vectors, spec, *TILE) for _ in range(3)))\n")
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", program], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=JOB_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < FAULTS_BOUND, (done.stdout, FAULTS_BOUND)  # the margins: beside it


def test_a_non_finite_job_fails_with_v1s_error(client):
    body = {"vectors": [[0.0], [1e20]], "factor": 2, "objective": "sum_of_squares"}
    done = wait_for_job(client, submit(client, **body).get_json()["id"])
    sync = client.post("/v1/gradients", json=body).get_json()["error"]
    assert done["status"] == "failed" and done["error"] == sync
    result = client.get(f"/v1/jobs/{done['id']}/result")
    assert result.status_code == 409 and "Retry-After" not in result.headers
    assert result.get_json()["error"]["details"] == {"status": "failed"}


def test_running_job_409_then_cancelled_and_max_jobs(cluster, tmp_path):
    """A job whose tiles are held at their start (so it is running, none done, when looked at):
    the next POST is over BLOCKGRAD_MAX_JOBS = 1, its result is 409 while it runs, DELETE
    cancels it with no block done and releases its tasks, and a small job then succeeds."""
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address,
                         "BLOCKGRAD_MAX_JOBS": "1"}).test_client()
    vectors = np.random.default_rng(3).standard_normal((256, 8)).astype(np.float32)
    with HeldTiles(cluster.address, tmp_path) as held:
        big = client.post("/v1/jobs?factor=16&objective=sum_of_squares", data=npy(vectors),
                          content_type="application/x-npy").get_json()
        assert big["status"] in ("queued", "running"), big
        held.wait_started(big["id"])
        small = {"vectors": [[1.0, 2.0], [3.0, 4.0]], "factor": 2}
        refused = client.post("/v1/jobs", json=small)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.get_json()["error"]["code"] == "overloaded"
        assert refused.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_MAX_JOBS"
        early = client.get(f"/v1/jobs/{big['id']}/result")
        assert early.status_code == 409 and early.headers["Retry-After"]
        assert early.get_json()["error"]["code"] == "job_not_done"
        assert early.get_json()["error"]["details"]["status"] == "running"
        running = client.get(f"/v1/jobs/{big['id']}").get_json()
        assert running["status"] == "running" and running["started_at"] is not None and running["finished_at"] is None
        assert running["progress"] == {"blocks_done": 0, "blocks_total": 256}
        cancelled = client.delete(f"/v1/jobs/{big['id']}")
        assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
        record = client.get(f"/v1/jobs/{big['id']}").get_json()
        assert record["status"] == "cancelled" and record["finished_at"] is not None
        assert record["progress"] == cancelled.get_json()["progress"] == {"blocks_done": 0, "blocks_total": 256}
        assert client.get(f"/v1/jobs/{big['id']}/result").get_json()["error"]["details"] == {"status": "cancelled"}
        held.release()  # the held tiles finish; no other starts
        dask = cluster_client(cluster.address)

        def released():
            return not any(big["id"] in str(key) for keys in dask.processing().values() for key in keys)
        assert wait_until(released, JOB_S, 0.2), dask.processing()
        [gone] = dask.run_on_scheduler(snapshots, [big["id"]]).values()  # its tiles, as the scheduler has them now
        assert gone["progress"]["done"] == 0  # the held tiles ended after the cancel: forgotten, not done
    after = client.post("/v1/jobs", json=small)
    assert after.status_code == 202, after.get_json()
    assert wait_for_job(client, after.get_json()["id"])["status"] == "succeeded"
    assert client.delete(f"/v1/jobs/{big['id']}").status_code == 204  # cancelled is finished: forgotten


def test_blocks_are_refused_with_the_reason():
    client = create_app({"TESTING": True}).test_client()  # refused before any cluster is asked
    response = client.post("/v1/jobs", json={"vectors": [[1.0]], "outputs": ["blocks", "losses"]})
    assert response.status_code == 422
    error = response.get_json()["error"]
    assert error["code"] == "validation_error" and "N x N x 2D" in str(error["details"]["fields"]["outputs"])
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
def test_bad_npy_bodies_are_clear_4xx(body, status, words):
    client = create_app({"TESTING": True}).test_client()
    response = client.post("/v1/jobs", data=body, content_type="application/x-npy")
    assert response.status_code == status, response.get_json()
    assert words in str(response.get_json()["error"]).lower() or words in str(response.get_json()["error"])


def test_npy_query_fields_follow_v1s_rules():
    client = create_app({"TESTING": True}).test_client()
    data = npy(np.ones((4, 2), dtype=np.float32))
    for query, field in (("factor=9", "factor"), ("factor=x", "factor"), ("dtype=float64", "dtype"),
                         ("objective=nope", "objective"), ("outputs=", "outputs"), ("colour=red", "colour")):
        response = client.post(f"/v1/jobs?{query}", data=data, content_type="application/x-npy")
        assert response.status_code == 422, query
        assert field in response.get_json()["error"]["details"]["fields"], query


def test_job_limits_are_their_own():
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_JOB_N": "16", "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS": "64",
                         "BLOCKGRAD_MAX_JOB_BODY_BYTES": "1024"}).test_client()
    too_many = client.post("/v1/jobs", json={"vectors": [[1.0]] * 17})
    assert too_many.status_code == 413 and too_many.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_MAX_JOB_N"
    big_block = client.post("/v1/jobs", json={"vectors": [[1.0, 2.0]] * 16, "factor": 2})  # 8 x 8 x 4 = 256
    details = big_block.get_json()["error"]["details"]
    assert big_block.status_code == 413 and details["limit"] == "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS"
    side = -(-16 // details["suggested_factor"])
    assert side * side * 4 <= 64  # the suggested factor fits
    body = client.post("/v1/jobs", data=npy(np.ones((16, 16))), content_type="application/x-npy")
    assert body.status_code == 413 and body.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_MAX_JOB_BODY_BYTES"
    # N over BLOCKGRAD_MAX_N = 8192 is a synchronous limit only: a job of N = 9000 is admitted.
    open_client = create_app({"TESTING": True, "BLOCKGRAD_MAX_N": "8"}).test_client()
    refused = open_client.post("/v1/jobs", json={"vectors": [[1.0]] * 9})
    assert refused.get_json()["error"]["code"] == "cluster_unavailable"  # past every limit, to the cluster


def test_unreachable_scheduler_is_503_within_5_s_and_v1_unaffected():
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": f"tcp://127.0.0.1:{free_port()}"}).test_client()
    calls = [lambda: client.post("/v1/jobs", json={"vectors": [[1.0]]}),
             lambda: client.get(f"/v1/jobs/{HEX_ID}"), lambda: client.get(f"/v1/jobs/{HEX_ID}/result"),
             lambda: client.delete(f"/v1/jobs/{HEX_ID}")]
    for call in calls:
        # No hang. The 5 s bound itself is proven on the deadline's clock, not the wall's, in
        # test_each_route_s_cluster_calls_share_one_deadline: a wall-clock verdict would fail
        # on a busy machine.
        response = answered(call)
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert response.get_json()["error"]["code"] == "cluster_unavailable"
    assert client.post("/v1/gradients", json={"vectors": [[1.0], [2.0]]}).status_code == 200
    ready = client.get("/readyz")  # readiness is about synchronous serving: never asks the cluster
    assert ready.status_code == 200 and ready.get_json()["cluster"]["connected"] is False


def test_concurrent_posts_with_one_key_make_one_job(cluster, jobs_app):
    """The key is taken with the record, in one step on the scheduler: POSTs sent at the same
    moment (each thread its own connection) all get the one job."""
    body = {"vectors": np.random.default_rng(4).standard_normal((64, 4)).tolist(), "factor": 4}
    key, count = f"together-{time.time_ns()}", 8
    start, answers = threading.Barrier(count), []

    def post():
        own = jobs_app.test_client()
        start.wait(timeout=60)
        answers.append(own.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}))
    threads = [threading.Thread(target=post) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == count and all(a.status_code == 202 for a in answers), [a.get_json() for a in answers]
    assert len({a.get_json()["id"] for a in answers}) == 1
    records = cluster_client(cluster.address).get_metadata([JOBS], {})
    assert sum(record.get("idempotency_key") == key for record in records.values()) == 1
    assert wait_for_job(jobs_app.test_client(), answers[0].get_json()["id"])["status"] == "succeeded"


CALL_COST_S = 1.25  # what each cluster call costs on the route's clock, below: four of them are over 5 s


def test_each_route_s_cluster_calls_share_one_deadline(cluster, client, monkeypatch):
    """A slow scheduler, played on the deadlines' clock: each call to it costs CALL_COST_S, or
    times out at its own timeout if that is shorter. Every job route answers having spent at
    most the 5 s it promises on its calls together (a 503 cluster_unavailable when they need
    more), however many calls it makes. Patched because the promise is a time: on the
    deadline's own clock it is exact and counted in calls (four of CALL_COST_S do not fit),
    where the wall's would make the verdict depend on the machine's load. Real unreachable
    clusters (an address nobody listens on; a SIGKILLed scheduler) are tested for their 503
    on every route and for not hanging in test_unreachable_scheduler_is_503_within_5_s_and_v1_unaffected
    and test_a_scheduler_restarted_mid_job_loses_its_jobs_and_v1_serves_throughout."""
    done = wait_for_job(client, submit(client, vectors=[[1.0], [2.0], [3.0]], factor=3).get_json()["id"])
    assert done["status"] == "succeeded"
    now, spent = [0.0], []
    real_sync = type(cluster_client(cluster.address)).sync

    def slow_sync(self, function, *args, callback_timeout=None, **kwargs):
        cost = min(CALL_COST_S, callback_timeout or CALL_COST_S)
        now[0] += cost
        spent[-1] += cost
        if cost < CALL_COST_S:
            raise TimeoutError("the call's timeout passed first")
        return real_sync(self, function, *args, callback_timeout=callback_timeout, **kwargs)

    monkeypatch.setattr(jobs_client, "clock", lambda: now[0])
    monkeypatch.setattr(type(cluster_client(cluster.address)), "sync", slow_sync)
    routes = {"POST": lambda: client.post("/v1/jobs", json={"vectors": [[1.0], [2.0]], "factor": 2}),
              "GET": lambda: client.get(f"/v1/jobs/{done['id']}"),
              "GET result": lambda: client.get(f"/v1/jobs/{done['id']}/result"),
              "DELETE": lambda: client.delete(f"/v1/jobs/{done['id']}")}
    for name, send in routes.items():
        spent.append(0.0)
        response = send()
        assert spent[-1] <= 5.0, (name, spent[-1], response.status_code)
        assert response.status_code < 300 or response.get_json()["error"]["code"] == "cluster_unavailable", name
    assert spent[0] > 4 and spent[-1] > 4  # these two needed more calls than fit: cut short, not skipped
    monkeypatch.undo()
    dask = cluster_client(cluster.address)
    for job_id, found in dask.run_on_scheduler(snapshots, None).items():  # the POST cut short left its record
        if not found["record"]["submitted"]:
            dask.run_on_scheduler(forget_records, job_id)


def test_a_result_is_reserved_in_the_worker_s_memory_ledger(cluster, client):
    """Sending a result holds the arrays and the body: reserved like /v1's answers, so a
    result that can never fit is 413 and one that only others' requests keep out is 503."""
    vectors = np.random.default_rng(9).standard_normal((300, 8))
    job = wait_for_job(client, submit(client, vectors=vectors.tolist(), factor=6, dtype="float64").get_json()["id"])
    url, npz = f"/v1/jobs/{job['id']}/result", {"Accept": "application/x-npz"}
    small = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address,
                        "BLOCKGRAD_WORKER_MEMORY_BYTES": str(16 * 1024)}).test_client()  # under the arrays
    for headers in ({}, npz):
        refused = small.get(url, headers=headers)
        assert refused.status_code == 413, refused.get_json()
        error = refused.get_json()["error"]
        assert error["code"] == "limit_exceeded" and error["details"]["limit"] == "BLOCKGRAD_WORKER_MEMORY_BYTES"
    assert "application/x-npz" in small.get(url).get_json()["error"]["message"]  # JSON's advice: the binary form
    ledger = services_of(client.application).ledger
    held = ledger.reserve(ledger.budget - 1024)  # another request's
    try:
        busy = client.get(url, headers=npz)
        assert busy.status_code == 503 and busy.headers["Retry-After"], busy.get_json()
        assert busy.get_json()["error"]["code"] == "overloaded"
    finally:
        held.release()
    assert client.get(url, headers=npz).status_code == 200
    assert ledger.reserved == 0  # given back with the answer


SUBMIT_DIES_BEFORE_THE_GRAPH = """
import os, sys
from app import create_app
from app.jobs import store
store.SUBMIT_GRACE_S = 0.0  # expire right after the POST's own deadline
def die(client, job_id, *args):
    print(job_id, flush=True)
    os.kill(os.getpid(), 9)  # the gunicorn worker killed between the record and the graph
store.submit = die
client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": sys.argv[1]}).test_client()
client.post("/v1/jobs", json={"vectors": [[1.0], [2.0]], "factor": 2})
"""


def test_a_record_whose_graph_never_came_expires(quiet_cluster):
    """A POST's process killed after writing the record, before submitting the graph: once its
    bound has passed, the record counts against BLOCKGRAD_MAX_JOBS no more and is 404."""
    cluster = quiet_cluster
    dask = cluster_client(cluster.address)
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address,
                         "BLOCKGRAD_MAX_JOBS": "1"}).test_client()
    assert_nothing_active(cluster.address)
    out = subprocess.run([sys.executable, "-c", SUBMIT_DIES_BEFORE_THE_GRAPH, cluster.address], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BLOCKGRAD_LOG_LEVEL": "WARNING"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    job_id = out.stdout.split()[0]
    record = dask.get_metadata([JOBS, job_id])
    assert record["submitted"] is False
    [snapshot] = dask.run_on_scheduler(snapshots, [job_id]).values()
    assert snapshot["progress"]["done"] == 0  # none of its tasks exists: none is done
    assert wait_until(lambda: time.time() > record["submit_by"], 60, 0.2)
    small = {"vectors": [[1.0, 2.0], [3.0, 4.0]], "factor": 2}
    after = client.post("/v1/jobs", json=small)  # the abandoned record is not one of BLOCKGRAD_MAX_JOBS = 1
    assert after.status_code == 202, after.get_json()
    missing = client.get(f"/v1/jobs/{job_id}")
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "job_not_found"
    assert job_id not in dask.get_metadata([JOBS], {})
    assert wait_for_job(client, after.get_json()["id"])["status"] == "succeeded"


def test_a_job_larger_than_a_synchronous_request_is_exact(cluster):
    """What jobs are for, at a size CI affords: BLOCKGRAD_MAX_N lowered to 64 on this server,
    N = 96 is refused synchronously (413, the limit named) and succeeds as a job. `sum` over
    vectors of small integers, so both outputs are exact in float32 and known in closed form:
    every gradient entry is 1, so the accumulated gradient is 2N everywhere; block (r, c) of
    side s has loss s * (S_r + S_c) + 5 * s * s * 2D, S_r the sum of block row r's vectors."""
    n, dim, factor, limit = 96, 3, 4, 64
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address,
                         "BLOCKGRAD_MAX_N": str(limit)}).test_client()
    vectors = (np.arange(n * dim).reshape(n, dim) % 7 - 3).astype(np.float32)
    body = {"vectors": vectors.tolist(), "factor": factor, "objective": "sum", "outputs": ["accumulated", "losses"]}
    refused = client.post("/v1/gradients", json=body)
    assert refused.status_code == 413, refused.get_json()
    assert refused.get_json()["error"]["code"] == "limit_exceeded"
    assert refused.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_MAX_N"
    job = wait_for_job(client, submit(client, **body).get_json()["id"])
    assert job["status"] == "succeeded" and job["n"] == n, job
    got = client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": "application/x-npz"})
    arrays = np.load(io.BytesIO(got.data), allow_pickle=False)
    assert arrays["accumulated"].shape == (n, dim) and (arrays["accumulated"] == 2 * n).all()
    side = n // factor
    row_sums = [sum(float(x) for x in vectors[r * side:(r + 1) * side].ravel()) for r in range(factor)]
    expected = [[side * (row_sums[r] + row_sums[c]) + 5.0 * side * side * 2 * dim for c in range(factor)]
                for r in range(factor)]
    assert arrays["losses"].tolist() == expected


@pytest.mark.skipif(os.environ.get("JOBS_LARGE_TEST") != "1", reason="about 100 s on 2 loaded cores: JOBS_LARGE_TEST=1")
def test_a_large_npy_job_succeeds(client):
    """N = 16,384 > BLOCKGRAD_MAX_N, D = 32, F = 64, `sum`: every gradient entry is 1, so the
    accumulated gradient is exactly 2N everywhere, and a block's loss is its sum plus 5 per entry."""
    n, dim, factor = 16384, 32, 64
    vectors = np.random.default_rng(2).standard_normal((n, dim)).astype(np.float32)
    job = client.post(f"/v1/jobs?factor={factor}&objective=sum", data=npy(vectors),
                      content_type="application/x-npy").get_json()
    assert wait_for_job(client, job["id"], 600)["status"] == "succeeded"
    got = client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": "application/x-npz"})
    arrays = np.load(io.BytesIO(got.data), allow_pickle=False)
    assert np.all(arrays["accumulated"] == 2 * n)
    side = n // factor
    sums = vectors.astype(np.float64).reshape(factor, side, dim).sum(axis=(1, 2))  # (F,)
    expected = side * (sums[:, None] + sums[None, :]) + 5.0 * side * side * 2 * dim
    assert_matches(arrays["losses"], expected, "float32", what="losses")


SUBMIT_AND_DIE = """
import os, sys
import numpy as np
from app import create_app
client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": sys.argv[1]}).test_client()
vectors = np.random.default_rng(5).standard_normal((600, 8))
record = client.post("/v1/jobs", json={"vectors": vectors.tolist(), "factor": 12, "dtype": "float64"}).get_json()
print(record["id"], flush=True)
os.kill(os.getpid(), 9)  # the process that accepted the job dies at once, as a SIGKILLed worker would
"""


def test_a_job_outlives_the_process_that_accepted_it(cluster, client):
    out = subprocess.run([sys.executable, "-c", SUBMIT_AND_DIE, cluster.address], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "BLOCKGRAD_LOG_LEVEL": "WARNING"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    job_id = out.stdout.split()[0]
    assert wait_for_job(client, job_id)["status"] == "succeeded"
    accumulated = client.get(f"/v1/jobs/{job_id}/result").get_json()["accumulated"]
    vectors = torch.tensor(np.random.default_rng(5).standard_normal((600, 8)))
    assert_matches(accumulated, reference_accumulated(vectors, 12, "sum", offset=5.0).numpy(), "float64")


def test_a_dask_worker_killed_mid_job_still_gives_the_exact_result(cluster, client, tmp_path):
    """It kills one of the two workers while it holds a tile of the job (the tiles are held at
    their start); the other holds a copy of the vectors (scattered to every worker) and reruns
    what was lost. The scheduler's log shows that tile processing again after the kill and
    computed; the result is /v1's, bit for bit. The killed one's nanny starts it again: the
    cluster is back to two workers, and the next job succeeds."""
    dask = cluster_client(cluster.address)
    vectors = np.random.default_rng(11).standard_normal((1536, 16))
    pids = dask.run(os.getpid)
    with HeldTiles(cluster.address, tmp_path) as held:
        job = client.post("/v1/jobs?factor=24&objective=sum_of_squares", data=npy(vectors),
                          content_type="application/x-npy").get_json()
        [(victim, lost), *_] = held.wait_started(job["id"])
        assert victim in pids.values()
        copies = dask.run_on_scheduler(input_copies, lost)
        assert copies and set(copies.values()) == {2}, copies  # the vectors: on the other worker too
        os.kill(victim, signal.SIGKILL)
        held.release()
        done = wait_for_job(client, job["id"], 3 * JOB_S)
    assert done["status"] == "succeeded", done
    states = dask.run_on_scheduler(task_runs, job["id"])[lost]  # the tile the victim held
    runs = [i for i, state in enumerate(states) if state == "processing"]
    assert len(runs) >= 2 and "memory" in states[runs[1]:], states  # lost with the worker, computed again
    got = client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": "application/x-npz"})
    arrays = np.load(io.BytesIO(got.data), allow_pickle=False)
    sync = create_app({"TESTING": True}).test_client().post("/v1/gradients", json={
        "vectors": vectors.tolist(), "factor": 24, "objective": "sum_of_squares", "dtype": "float64",
        "outputs": ["accumulated", "losses"]}).get_json()
    assert arrays["losses"].tolist() == sync["losses"]
    assert_matches(arrays["accumulated"], sync["accumulated"], "float64", what="accumulated")

    def restarted():
        workers = dask.run(os.getpid)
        return len(workers) == 2 and victim not in workers.values()
    assert wait_until(restarted, CLUSTER_START_S, 0.5)  # a new worker process
    small = submit(client, vectors=[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], factor=3).get_json()
    assert wait_for_job(client, small["id"])["status"] == "succeeded"


def test_a_scheduler_restarted_mid_job_loses_its_jobs_and_v1_serves_throughout(tmp_path):
    """A cluster of its own: its scheduler is SIGKILLed while a job runs (its one tile held at
    its start, so it is running; its supervisor held
    stopped meanwhile, so that the scheduler stays down). While it is down every job route is
    503 cluster_unavailable (its calls bounded by the route's deadline); the supervisor then
    starts a scheduler at the same address by itself, the lost job is 404, the workers rejoin
    and a new job succeeds; /v1/gradients answers throughout."""
    own = start_embedded(1)
    [supervisor] = own.processes
    try:
        wait_for_workers(own.address, 1)
        client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": own.address}).test_client()
        small = {"vectors": [[1.0, 2.0], [3.0, 4.0]], "factor": 2}

        def v1_serves():
            assert client.post("/v1/gradients", json=small).status_code == 200
        vectors = np.random.default_rng(8).standard_normal((256, 8)).astype(np.float32)
        held = HeldTiles(own.address, tmp_path).__enter__()
        job = client.post("/v1/jobs?factor=16&objective=sum_of_squares", data=npy(vectors),
                          content_type="application/x-npy").get_json()
        held.wait_started(job["id"])
        assert client.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "running"
        [scheduler] = supervised(supervisor.pid, "scheduler")
        os.kill(supervisor.pid, signal.SIGSTOP)
        try:
            os.kill(scheduler, signal.SIGKILL)
            held.release()  # the worker's one thread is free for what follows
            assert wait_until(lambda: client.get(f"/v1/jobs/{job['id']}").status_code == 503, CLUSTER_START_S, 0.2)
            for method, path in (("post", ""), ("get", f"/{job['id']}"), ("get", f"/{job['id']}/result"),
                                 ("delete", f"/{job['id']}")):
                kwargs = {"json": small} if method == "post" else {}
                response = getattr(client, method)(f"/v1/jobs{path}", **kwargs)
                assert response.status_code == 503 and response.headers["Retry-After"], (method, path)
                assert response.get_json()["error"]["code"] == "cluster_unavailable"
                v1_serves()
        finally:
            os.kill(supervisor.pid, signal.SIGCONT)
        answers = []

        def answered():
            v1_serves()
            answers.append(client.get(f"/v1/jobs/{job['id']}"))
            return answers[-1].status_code != 503
        assert wait_until(answered, CLUSTER_START_S, 0.5)
        lost = f"/v1/jobs/{job['id']}"
        for response in (answers[-1], client.get(lost + "/result"), client.delete(lost)):
            assert response.status_code == 404 and response.get_json()["error"]["code"] == "job_not_found"
        wait_for_workers(own.address, 1)
        created = []

        def submitted():  # the first POSTs may meet a scheduler with no worker yet: 503, as documented
            created.append(client.post("/v1/jobs", json={"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 3}))
            return created[-1].status_code == 202
        assert wait_until(submitted, CLUSTER_START_S, 0.5)
        assert wait_for_job(client, created[-1].get_json()["id"])["status"] == "succeeded"
        [nanny] = supervised(supervisor.pid, "worker")
        os.kill(nanny, signal.SIGKILL)  # a worker's nanny itself: the supervisor starts another
        assert wait_until(lambda: supervised(supervisor.pid, "worker") not in ([], [nanny]), CLUSTER_START_S, 0.2)
    finally:
        close_clients(own.address)
        stop_embedded(own)
    assert supervisor.returncode is not None


def supervised(supervisor: int, role: str) -> list[int]:
    """The supervisor's live `dask <role>` children."""
    found = []
    for pid in children(supervisor):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if dask_role(line) == role and state != "Z":
            found.append(pid)
    return found


def test_a_finished_job_past_its_ttl_is_404_on_every_route_without_waiting_for_a_post(cluster):
    """BLOCKGRAD_JOB_TTL_S applies when the job is read, not only at the next POST's sweep: the
    same job is 200 under a long TTL and 404 job_not_found once read under a TTL it has outlived."""
    app = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": cluster.address})
    client = app.test_client()
    job = submit(client, vectors=[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], factor=3).get_json()
    assert wait_for_job(client, job["id"])["status"] == "succeeded"
    assert client.get(f"/v1/jobs/{job['id']}/result").status_code == 200
    store = services_of(app).jobs
    time.sleep(0.05)  # the job finished at least this long ago
    store.settings = dataclasses.replace(store.settings, job_ttl_s=0.01)
    for path in ("", "/result"):
        response = client.get(f"/v1/jobs/{job['id']}{path}")
        assert response.status_code == 404 and response.get_json()["error"]["code"] == "job_not_found", path
    assert job["id"] not in cluster_client(cluster.address).run_on_scheduler(snapshots, [job["id"]])  # forgotten
