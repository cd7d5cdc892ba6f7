"""Jobs with a model objective (examples/export_scorer.py's scorer) on a real local Dask
cluster of two workers, run by a job runner with the app's objectives: the same numbers as
/v1, the program shipped by content and loaded once per worker, and a program that fails its
checks there fails the job."""
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from app import create_app
from app.core.job_models import ProgramError, job_objective, program_hash, program_loads
from app.extensions import services_of
from app.jobs.programs import program_key
from examples.export_scorer import export_scorer
from tests.numeric import assert_matches, largest
from tests.dask_cluster import cluster_client, npy, running, store_config, wait_for_job

DIM = 4
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    """The example scorer exported twice: float32 (`relnet`) and float64 (`relnet64`)."""
    root = tmp_path_factory.mktemp("scorers")
    export_scorer(root / "relnet.pt2", DIM, 16, torch.float32, seed=1)
    export_scorer(root / "relnet64.pt2", DIM, 16, torch.float64, seed=2)
    return root


def served_app(directory: Path, store: Path, **settings):
    """An app serving the models in `directory`, its job store in `store`."""
    return create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory), **store_config(store), **settings})


@pytest.fixture(scope="module")
def client(cluster, scorers, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    app = served_app(scorers, store)
    with running(cluster.address, store_config(store), services_of(app).objectives):
        yield app.test_client()


def sync_answer(client, body: dict) -> dict:
    answer = client.post("/v1/gradients", json={**body, "outputs": ["accumulated", "losses"]}).get_json()
    assert "error" not in answer, answer
    return answer


def loads_on_workers(address: str, sha256: str) -> dict[str, int]:
    return {worker: loads.get(sha256, 0) for worker, loads in cluster_client(address).run(program_loads).items()}


def test_model_jobs_equal_v1_and_load_the_program_once_per_worker(cluster, runner, tmp_path, monkeypatch):
    """A program of its own (no other test ships its bytes): shipped once for two jobs."""
    from distributed import Client

    export_scorer(tmp_path / "relnet.pt2", DIM, 16, torch.float32, seed=7)
    app = served_app(tmp_path, tmp_path)
    client = app.test_client()
    programs_before = {key for key in cluster_client(cluster.address).who_has() if key.startswith("blockgrad-program-")}
    scatters = []
    real_scatter = Client.scatter

    def counted(dask, data, *args, **kwargs):
        if isinstance(data, dict):  # a program, by its key (a job's vectors go as a list)
            scatters.append(data)
        return real_scatter(dask, data, *args, **kwargs)
    monkeypatch.setattr(Client, "scatter", counted)
    runner(app)
    vectors = np.random.default_rng(4).standard_normal((48, DIM)).astype(np.float32)
    body = {"vectors": vectors.tolist(), "factor": 6, "objective": "relnet", "dtype": "float32"}
    first = client.post("/v1/jobs", json=body)
    assert first.status_code == 202, first.get_json()
    assert first.get_json()["objective"] == "relnet"
    done = wait_for_job(client, first.get_json()["id"])
    assert done["status"] == "succeeded", done
    job = client.get(f"/v1/jobs/{done['id']}/result").get_json()
    sync = sync_answer(client, body)
    assert np.array_equal(np.array(job["losses"], dtype=np.float32), np.array(sync["losses"], dtype=np.float32))
    accumulated = np.array(sync["accumulated"])
    assert_matches(job["accumulated"], accumulated, "float32", scale=largest(accumulated), what="accumulated")

    again = client.post("/v1/jobs?factor=6&objective=relnet", data=npy(vectors), content_type="application/x-npy")
    assert again.status_code == 202, again.get_json()
    assert wait_for_job(client, again.get_json()["id"])["status"] == "succeeded"
    binary = client.get(f"/v1/jobs/{again.get_json()['id']}/result", headers={"Accept": "application/x-npz"})
    arrays = np.load(io.BytesIO(binary.data), allow_pickle=False)
    assert np.array_equal(arrays["losses"], np.array(sync["losses"], dtype=np.float32))

    sha256 = program_hash((tmp_path / "relnet.pt2").read_bytes())
    assert [list(data) for data in scatters] == [[program_key(sha256)]]  # shipped once for both jobs
    loads = loads_on_workers(cluster.address, sha256)
    assert len(loads) == 2 and set(loads.values()) <= {0, 1} and sum(loads.values()) >= 1, loads  # two jobs
    holders = cluster_client(cluster.address).who_has()
    assert len(holders.get(program_key(sha256), ())) == 2  # the bytes, under their hash, on both workers
    assert {key for key in holders if key.startswith("blockgrad-program-")} - programs_before == {program_key(sha256)}


def test_a_float64_model_job_equals_v1_in_its_losses(client):
    """Within float64's tolerance, not bit for bit: a model's matrix product rounds by the
    number of pairs in its batch (docs/models.md), and a job's tile stacks fewer blocks of a
    shape than /v1's whole request (seen: 1 ulp on one of 16 losses)."""
    vectors = np.random.default_rng(5).standard_normal((30, DIM))
    body = {"vectors": vectors.tolist(), "factor": 4, "objective": "relnet64", "dtype": "float64"}
    done = wait_for_job(client, client.post("/v1/jobs", json=body).get_json()["id"])
    assert done["status"] == "succeeded", done
    job = client.get(f"/v1/jobs/{done['id']}/result").get_json()
    sync = sync_answer(client, body)
    losses = np.array(sync["losses"])
    assert_matches(job["losses"], losses, "float64", scale=largest(losses), what="losses")
    accumulated = np.array(sync["accumulated"])
    assert_matches(job["accumulated"], accumulated, "float64", scale=largest(accumulated), what="accumulated")


def test_a_job_ships_the_program_the_service_loaded_even_if_its_file_is_replaced(runner, scorers, tmp_path):
    """The file is replaced after the service loaded it: /v1 serves the program it loaded, and so
    does a job (its bytes kept at load, not read again), so the two still answer alike."""
    directory = tmp_path / "models"
    directory.mkdir()
    shutil.copy(scorers / "relnet.pt2", directory / "swapped.pt2")
    app = served_app(directory, tmp_path)
    runner(app)
    client = app.test_client()
    (directory / "swapped.pt2").write_bytes(b"not an exported program any more")
    vectors = np.random.default_rng(6).standard_normal((12, DIM)).astype(np.float32)
    body = {"vectors": vectors.tolist(), "factor": 3, "objective": "swapped", "dtype": "float32"}
    done = wait_for_job(client, client.post("/v1/jobs", json=body).get_json()["id"])
    assert done["status"] == "succeeded", done
    job = client.get(f"/v1/jobs/{done['id']}/result").get_json()
    assert job["losses"] == sync_answer(client, body)["losses"]


def test_a_program_that_fails_its_checks_on_the_workers_fails_the_job(runner, scorers, tmp_path):
    """Bytes the workers refuse (not an exported program): the job fails with the error table's
    code, the workers' paths stay theirs, and the service still serves its own copy."""
    directory = tmp_path / "models"
    directory.mkdir()
    shutil.copy(scorers / "relnet.pt2", directory / "swapped.pt2")
    app = served_app(directory, tmp_path)
    runner(app)
    client = app.test_client()
    services_of(app).objectives["swapped"].program = b"not an exported program any more"
    vectors = np.random.default_rng(6).standard_normal((12, DIM)).astype(np.float32)
    body = {"vectors": vectors.tolist(), "factor": 3, "objective": "swapped", "dtype": "float32"}
    done = wait_for_job(client, client.post("/v1/jobs", json=body).get_json()["id"])
    assert done["status"] == "failed", done
    error = done["error"]
    assert error["code"] == "internal_error" and error["details"] == {"objective": "swapped"}
    assert "load checks" in error["message"] and "cannot be loaded" in error["message"]
    assert str(tmp_path) not in error["message"]
    assert client.post("/v1/gradients", json=body).status_code == 200


def test_model_job_requests_follow_v1s_rules(scorers, tmp_path):
    client = served_app(scorers, tmp_path).test_client()  # refused before anything is stored
    wrong_dim = client.post("/v1/jobs", json={"vectors": [[1.0, 2.0]] * 4, "objective": "relnet"})
    assert wrong_dim.status_code == 422 and "vectors" in wrong_dim.get_json()["error"]["details"]["fields"]
    wrong_dtype = client.post("/v1/jobs?objective=relnet", data=npy(np.ones((4, DIM))), content_type="application/x-npy")
    assert wrong_dtype.status_code == 422 and "dtype" in wrong_dtype.get_json()["error"]["details"]["fields"]
    small = served_app(scorers, tmp_path, BLOCKGRAD_MAX_ACTIVATION_BYTES="1000").test_client()
    big_block = small.post("/v1/jobs", json={"vectors": [[0.5] * DIM] * 16, "factor": 1, "objective": "relnet"})
    assert big_block.status_code == 413
    assert big_block.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_MAX_ACTIVATION_BYTES"


def test_a_worker_checks_the_bytes_and_the_jobs_d(scorers):
    data = (scorers / "relnet.pt2").read_bytes()
    sha256 = program_hash(data)
    objective = job_objective("relnet", DIM, "float32", sha256, data)
    assert job_objective("relnet", DIM, "float32", sha256, data) is objective  # loaded once, kept by hash
    assert program_loads()[sha256] == 1
    with pytest.raises(ProgramError, match="D = 4"):
        job_objective("relnet", DIM + 1, "float32", sha256, data)
    with pytest.raises(ProgramError, match="do not match their hash"):
        job_objective("other", DIM, "float32", "0" * 64, data)
