"""A job holds and moves only the outputs it asked for, and admission bounds each of them
before anything runs (issue 30): the amplifying jobs of the hostile round, at the task level,
through the routes, and on the server as `make serve` starts it."""
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from app.core.job_tasks import Tile, finish, plan_tiles, run_tile, tile_partial, tile_spans
from app.core.objectives import OBJECTIVES
from app.jobs import db
from tests.events import HANG_S
from tests.numeric import assert_matches
from tests.test_job_tiles import run_job, spec_for
from tests.test_jobs import error_of, make_app, npy
from tools.reference import reference_accumulated
from tools.server import wait_until

NPY = "application/x-npy"
MiB = 1024 * 1024
SUBSETS = [("accumulated",), ("losses",), ("accumulated", "losses")]
# The hostile round's bodies: D = 1, factor = N (one pair per block), float64.
AMPLIFYING = (4096, ("accumulated",))  # 32 KiB asked; its losses would be 128 MiB
LOSSES_ONLY = (8192, ("losses",))  # 512 MiB of losses: over BLOCKGRAD_MAX_JOB_RESULT_BYTES
NPY_N = 131072  # a 512 KiB .npy (float32) whose default outputs imply 64 GiB of losses


def amplifying_body(n: int, outputs, seed: int = 0) -> dict:
    return {"vectors": np.random.default_rng(seed).standard_normal((n, 1)).round(3).tolist(), "factor": n,
            "outputs": list(outputs), "dtype": "float64"}


def stored_jobs(store_url: str) -> int:
    engine = db.open_store(store_url)
    try:
        counts = db.status_counts(engine)
        return sum(count for name, count in counts.items() if name != "blocks_done")
    finally:
        engine.dispose()


# -- the tasks ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("outputs", SUBSETS)
def test_a_tile_of_the_amplifying_job_sends_only_what_was_asked(outputs):
    """The first tile of N = 4096, D = 1, factor = 4096: (rows + cols) x D numbers for the
    accumulated gradient, rows x cols blocks' losses, nothing of an output not asked for."""
    n = AMPLIFYING[0]
    spec = dataclasses.replace(spec_for(n, 1, n, "sum", "float64"), outputs=outputs)
    tile = plan_tiles(n, 1, n, workers=2)[0]
    _, height, _, width = tile_spans(spec, tile)
    part = run_tile(np.ones((n, 1)), spec, tile, OBJECTIVES["sum"])
    sums = (height + width) * 8 if "accumulated" in outputs else 0
    losses = tile.blocks * 8 if "losses" in outputs else 0
    assert part.nbytes == sums + losses, (part.nbytes, sums, losses)
    assert part.row_sums.shape == ((height, 1) if sums else (0, 0))
    assert part.losses.shape == ((len(tile.rows), len(tile.cols)) if losses else (0, 0))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("outputs", SUBSETS)
@pytest.mark.parametrize("bands", [True, False])
def test_every_output_subset_is_exact_and_alone(outputs, bands):
    """The amplifying shape (D = 1, factor = N) at N = 40: what was asked equals the literal
    loops (accumulated) and /v1's engine bit for bit (losses); what was not is empty; the bytes
    moved are the asked outputs' pieces only."""
    n = 40
    vectors = np.random.default_rng(7).standard_normal((n, 1)).round(3)
    spec = dataclasses.replace(spec_for(n, 1, n, "sum_of_squares", "float64"), outputs=outputs)
    every = dataclasses.replace(spec, outputs=("accumulated", "losses"))
    tiles, outcome, _ = run_job(vectors, spec, workers=2, tile_numbers=64, bands=bands)
    _, full, _ = run_job(vectors, every, workers=2, tile_numbers=64, bands=bands)
    assert outcome.error is None and len(tiles) > 4
    if "accumulated" in outputs:
        assert_matches(outcome.accumulated, reference_accumulated(torch.tensor(vectors), n, "sum_of_squares").numpy(),
                       "float64", what="accumulated vs reference")
    else:
        assert outcome.accumulated.size == 0
    if "losses" in outputs:
        pairs = vectors[:, None, 0] ** 2 + vectors[None, :, 0] ** 2  # one pair per block: (v_i, v_j)
        assert_matches(outcome.losses, pairs, "float64", what="losses vs the literal sum of squares")
        assert np.array_equal(outcome.losses, full.losses)
    else:
        assert outcome.losses.size == 0
    if outputs != every.outputs:
        assert 0 < outcome.bytes_moved < full.bytes_moved


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("bands", [True, False])
def test_the_bytes_moved_for_both_outputs_are_those_of_each_alone(bands):
    """Nothing of one output travels with the other: each alone moves its own share."""
    vectors = np.random.default_rng(8).standard_normal((40, 1))
    spec = spec_for(40, 1, 40, "sum", "float64")
    moved = {outputs: run_job(vectors, dataclasses.replace(spec, outputs=outputs), workers=2, tile_numbers=64,
                              bands=bands)[1].bytes_moved for outputs in SUBSETS}
    assert moved[SUBSETS[0]] + moved[SUBSETS[1]] == moved[SUBSETS[2]], moved


def test_finish_makes_no_array_of_an_output_not_asked_for():
    """The last task of a job with F = 8192, given one block's partial: an outputs=accumulated
    job's makes no (F, F) array (512 MiB in float64), an outputs=losses job's no (N, D)."""
    spec = spec_for(8192, 1, 8192, "sum", "float64")
    block = Tile(0, range(1), range(1))
    for outputs, made, absent in ((("accumulated",), "accumulated", "losses"), (("losses",), "losses", "accumulated")):
        asked = dataclasses.replace(spec, outputs=outputs)
        part = tile_partial(asked, block, np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)), 0.0, None)
        outcome = finish(asked, part)
        assert getattr(outcome, absent).nbytes == 0, outputs
        assert getattr(outcome, made).shape == {"accumulated": (8192, 1), "losses": (8192, 8192)}[made]


# -- admission ----------------------------------------------------------------------------------
@pytest.fixture
def store_url(tmp_path):
    return f"sqlite:///{tmp_path}/jobs.sqlite3"


def test_a_result_over_the_one_job_limit_is_413_before_anything_is_stored(store_url):
    client = make_app(store_url).test_client()
    n, outputs = LOSSES_ONLY
    details = error_of(client.post("/v1/jobs", json=amplifying_body(n, outputs)), 413, "limit_exceeded")["details"]
    assert details == {"limit": "BLOCKGRAD_MAX_JOB_RESULT_BYTES", "value": n * n * 8, "allowed": 256 * MiB}
    body = npy(np.ones((NPY_N, 1), np.float32))
    assert len(body) < 512 * 1024 + 256  # the 512 KiB body
    as_npy = client.post(f"/v1/jobs?factor={NPY_N}", data=body, content_type=NPY)
    details = error_of(as_npy, 413, "limit_exceeded")["details"]
    assert details["value"] == (NPY_N + NPY_N ** 2) * 4 and details["limit"] == "BLOCKGRAD_MAX_JOB_RESULT_BYTES"
    assert stored_jobs(store_url) == 0
    # What fits is accepted: the amplifying job asks for 32 KiB; losses in float32 are 256 MiB exactly.
    n, outputs = AMPLIFYING
    assert client.post("/v1/jobs", json=amplifying_body(n, outputs)).status_code == 202
    exact = client.post("/v1/jobs", json={**amplifying_body(LOSSES_ONLY[0], LOSSES_ONLY[1]), "dtype": "float32"})
    assert exact.status_code == 202, exact.get_json()
    assert stored_jobs(store_url) == 2


def test_the_smaller_of_the_two_result_limits_is_named(store_url):
    client = make_app(store_url, BLOCKGRAD_MAX_JOB_RESULTS_BYTES=str(MiB)).test_client()
    details = error_of(client.post("/v1/jobs", json=amplifying_body(1024, ("losses",))), 413,
                       "limit_exceeded")["details"]
    assert details == {"limit": "BLOCKGRAD_MAX_JOB_RESULTS_BYTES", "value": 8 * MiB, "allowed": MiB}


def test_outputs_not_valid_are_named_by_the_validation_not_sized(store_url):
    client = make_app(store_url).test_client()
    body = {**amplifying_body(LOSSES_ONLY[0], ("losses",)), "outputs": ["losses", "blocks"]}
    assert "outputs" in error_of(client.post("/v1/jobs", json=body), 422, "validation_error")["details"]["fields"]
    as_npy = client.post(f"/v1/jobs?factor={NPY_N}&outputs=losses,nope", data=npy(np.ones((NPY_N, 1), np.float32)),
                         content_type=NPY)
    assert "outputs" in error_of(as_npy, 422, "validation_error")["details"]["fields"]
    assert stored_jobs(store_url) == 0


def test_npy_bodies_meet_every_size_limit_before_anything_is_stored(store_url):
    client = make_app(store_url, BLOCKGRAD_MAX_JOB_N="16", BLOCKGRAD_MAX_D="2",
                      BLOCKGRAD_MAX_JOB_RESULT_BYTES="1024").test_client()
    for shape, query, limit in (((17, 1), "", "BLOCKGRAD_MAX_JOB_N"), ((4, 3), "", "BLOCKGRAD_MAX_D"),
                                ((16, 1), "?factor=16&outputs=losses", "BLOCKGRAD_MAX_JOB_RESULT_BYTES")):
        answer = client.post(f"/v1/jobs{query}", data=npy(np.ones(shape)), content_type=NPY)
        assert error_of(answer, 413, "limit_exceeded")["details"]["limit"] == limit
    assert stored_jobs(store_url) == 0
    assert client.post("/v1/jobs?factor=11&outputs=losses", data=npy(np.ones((16, 1))),
                       content_type=NPY).status_code == 202  # 11 x 11 x 8 = 968 bytes fit


# -- on the server users run --------------------------------------------------------------------
def runner_events(log: str, job_id: str) -> dict[str, dict]:
    """The runner's JSON log lines about one job, by event."""
    found = {}
    for line in log.splitlines():
        start = line.find('{"event": "job_')
        if start >= 0 and f'"job": "{job_id}"' in line:
            event = json.loads(line[start:])
            found[event["event"]] = event
    return found


@pytest.mark.slow
def test_the_amplifying_jobs_on_the_server_users_run(served):
    """The hostile round replayed as sent: the 512 KiB .npy and the 512 MiB of losses are 413
    and store nothing; the amplifying job runs moving no loss (on 2 workers 4 tiles x (2048 +
    2048) x 8 bytes = 128 KiB; its losses would be 128 MiB), and its answer is its accumulated
    alone, equal to the literal loops at N = 48 with the same shape of request."""
    store_url = f"sqlite:///{served.log_path.parent}/data/jobs.sqlite3"
    before = stored_jobs(store_url)
    refused = requests.post(f"{served.url}/v1/jobs?factor={NPY_N}", data=npy(np.ones((NPY_N, 1), np.float32)),
                            headers={"Content-Type": NPY}, timeout=HANG_S)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "limit_exceeded", refused.text
    n, outputs = LOSSES_ONLY
    refused = requests.post(f"{served.url}/v1/jobs", json=amplifying_body(n, outputs), timeout=HANG_S)
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["details"] == {"limit": "BLOCKGRAD_MAX_JOB_RESULT_BYTES", "value": n * n * 8,
                                                  "allowed": 256 * MiB}
    assert stored_jobs(store_url) == before
    n = AMPLIFYING[0]
    amplifying = submitted(served, amplifying_body(n, AMPLIFYING[1]))
    small_body = amplifying_body(48, AMPLIFYING[1], seed=48)
    small = submitted(served, small_body)
    assert np.array(succeeded(served, amplifying)["accumulated"]).shape == (n, 1)
    events = {}

    def logged():  # the runner logs job_finished after its commit: a moment after the status
        events.update(runner_events(served.log(), amplifying))
        return "job_finished" in events
    assert wait_until(logged, 60, 0.2), events
    # (rows + cols) x D per tile and band: a few MiB at most on any number of workers
    assert events["job_finished"]["bytes_moved"] < 4 * MiB < n * n * 8, events
    vectors = torch.tensor(small_body["vectors"], dtype=torch.float64)
    assert_matches(np.array(succeeded(served, small)["accumulated"]), reference_accumulated(vectors, 48, "sum").numpy(),
                   "float64", what="accumulated vs reference")


def submitted(served, body: dict) -> str:
    posted = requests.post(f"{served.url}/v1/jobs", json=body, timeout=HANG_S)
    assert posted.status_code == 202, posted.text
    return posted.json()["id"]


def succeeded(served, job_id: str) -> dict:
    """The job's result once it succeeded: only the outputs asked for."""
    location = f"{served.url}/v1/jobs/{job_id}"
    assert wait_until(lambda: requests.get(location, timeout=HANG_S).json()["status"] not in ("queued", "running"),
                      120, 0.3), f"job {job_id} did not finish"
    record = requests.get(location, timeout=HANG_S).json()
    assert record["status"] == "succeeded", record
    result = requests.get(location + "/result", timeout=HANG_S).json()
    assert "losses" not in result, list(result)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("accept", ["application/json", "application/x-npz"])
def test_concurrent_downloads_of_a_kept_result_are_all_served_whole(served, accept):
    """Six clients download one result at once (the hostile round's six): every one gets the
    whole body, byte for byte the body a lone download gets, and the worker's ledger (each
    download's reservation) holds them all: none is refused."""
    body = {"vectors": np.random.default_rng(6).standard_normal((512, 8)).tolist(), "factor": 8,
            "outputs": ["accumulated"]}
    job_id = submitted(served, body)
    succeeded_record = succeeded(served, job_id)
    url = f"{served.url}/v1/jobs/{job_id}/result"
    alone = requests.get(url, headers={"Accept": accept}, timeout=HANG_S)
    assert alone.status_code == 200 and len(alone.content) > 0
    start = threading.Barrier(6)

    def download(_):
        start.wait(timeout=HANG_S)
        return requests.get(url, headers={"Accept": accept}, timeout=HANG_S)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(download, range(6)))
    assert [answer.status_code for answer in answers] == [200] * 6, [answer.text[:300] for answer in answers]
    assert all(answer.content == alone.content for answer in answers)
    assert np.array(succeeded_record["accumulated"]).shape == (512, 8)
