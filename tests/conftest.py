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
    scheduler and two single-threaded workers on 127.0.0.1 under their supervisor (which starts
    again whichever exits), without its job runner (tests run theirs: `runner`), stopped after
    the module. Its TLS credentials are this process's Dask configuration meanwhile (the
    Clients of tests' runner threads use them)."""
    import dask.config

    from app.jobs.cluster import start_embedded, stop_embedded
    from tests.dask_cluster import close_clients, cluster_config, wait_for_workers

    cluster = start_embedded(2, runner=False)
    try:
        with dask.config.set(cluster_config(cluster.address)):
            wait_for_workers(cluster.address, 2)
            yield cluster
    finally:
        close_clients()
        stop_embedded(cluster)


@pytest.fixture
def runner(cluster, tmp_path):
    """start(app=None, **settings) -> a job runner thread (app/jobs/runner.py) of the module's
    cluster, on the SQLite store in this test's tmp_path (`store_config`), with `app`'s objectives
    (else the built-ins); every one started is stopped after the test. Give create_app the same
    `store_config` so that the app and the runner share the store."""
    from contextlib import ExitStack

    from app.extensions import services_of
    from tests.dask_cluster import running, store_config

    with ExitStack() as stack:
        def start(app=None, **settings):
            objectives = services_of(app).objectives if app is not None else None
            return stack.enter_context(running(cluster.address, store_config(tmp_path, **settings), objectives))
        yield start


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
