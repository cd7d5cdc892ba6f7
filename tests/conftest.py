import pytest
import torch

from app import create_app


@pytest.fixture
def app(tmp_path):
    return create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)})  # its job store: never ./data


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def one_thread():
    """One torch thread, as in a gunicorn worker and every Dask task: bitwise comparisons need
    it (with several threads torch may split one large reduction, changing a sum's order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster():
    """A real local Dask cluster for one test module: app/jobs/cluster.py's embedded one, a
    scheduler and two single-threaded workers on 127.0.0.1, stopped after the module."""
    from app.jobs.client import close_clients
    from app.jobs.cluster import start_embedded, stop_embedded
    from tests.dask_cluster import wait_for_workers

    cluster = start_embedded(2)
    try:
        wait_for_workers(cluster.address, 2)
        yield cluster
    finally:
        close_clients()
        stop_embedded(cluster)


# --- The service as users run it (issue 27): one gunicorn for the whole session ------------
@pytest.fixture(scope="session")
def served():
    """The service as `make serve` starts it: tools/server.py's gunicorn_server (gunicorn -c
    gunicorn.conf.py wsgi:app), with gunicorn.conf.py's worker count and the app's default
    device, and the embedded Dask cluster that on_starting starts when BLOCKGRAD_DASK_SCHEDULER
    is unset (gunicorn_server sets it to `off` unless told otherwise: set empty here, which is
    unset). Nothing else is overridden: the contract is tested at the defaults users get.
    Tests that use it must not change it (no recycling, no kills, no settings)."""
    from tools.server import gunicorn_server

    with gunicorn_server(workers=None, device=None, env={"BLOCKGRAD_DASK_SCHEDULER": ""}) as server:
        yield server


pytest_plugins = ["tests._guard", "tests.postgres"]
