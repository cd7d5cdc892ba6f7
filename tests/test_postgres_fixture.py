"""tests/postgres.py gives the job store's tests a real PostgreSQL: a fresh database per test,
a server that leaves nothing behind, and an endpoint that never answers."""
import socket

import psutil
import psycopg
import pytest
import sqlalchemy

from tests.postgres import running_postgres

# database names seen by test_each_test_gets_a_fresh_database, in the order they ran
SEEN: list[str] = []


def test_a_row_written_is_read_back_from_a_real_postgresql_18(postgres_url):
    with psycopg.connect(postgres_url) as conn:
        assert conn.info.server_version // 10000 == 18
        conn.execute("CREATE TABLE jobs (id text PRIMARY KEY, blocks_done integer, data bytea)")
        conn.execute("INSERT INTO jobs VALUES (%s, %s, %s)", ("a" * 32, 7, b"\x00\xffrow"))
    with psycopg.connect(postgres_url) as conn:  # committed: another connection sees it
        assert conn.execute("SELECT id, blocks_done, data FROM jobs").fetchall() == [("a" * 32, 7, b"\x00\xffrow")]


def test_the_url_opens_with_sqlalchemy_and_psycopg_as_the_store_does(postgres_url):
    engine = sqlalchemy.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            assert conn.dialect.driver == "psycopg"
            name = conn.execute(sqlalchemy.text("SELECT current_database()")).scalar_one()
    finally:
        engine.dispose()
    assert postgres_url.split("?")[0].endswith("/" + name)


@pytest.mark.parametrize("run", [1, 2])
def test_each_test_gets_a_fresh_database(run, postgres_url, postgres_server):
    with psycopg.connect(postgres_url) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]
        tables = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
        conn.execute("CREATE TABLE left_behind (x integer)")  # the other run must not see it
    assert tables == []
    assert name not in SEEN
    with psycopg.connect(postgres_server.get_uri()) as admin:
        databases = {row[0] for row in admin.execute("SELECT datname FROM pg_database")}
    assert name in databases
    assert not databases & set(SEEN), "an earlier test's database was not dropped"
    SEEN.append(name)


def running(process: psutil.Process) -> bool:
    """Alive, not a zombie waiting for init to reap it (pg_ctl's postmaster is init's child)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_server_stops_and_leaves_nothing_running_or_on_disk():
    with running_postgres() as server:
        pgdata = server.pgdata
        postmaster = psutil.Process(server.get_pid())
        with psycopg.connect(server.get_uri()) as conn:
            backends = conn.execute("SELECT count(*) FROM pg_stat_activity").fetchone()[0]
            children = postmaster.children()  # checkpointer, walwriter, ..., this connection's backend
        assert backends >= 1 and children and running(postmaster)
        processes = [postmaster, *children]
    assert [p for p in processes if running(p)] == []
    assert not pgdata.parent.exists()


def test_the_dead_url_accepts_tcp_and_never_answers(dead_postgres_url):
    port = int(dead_postgres_url.split("@127.0.0.1:")[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:  # the handshake completes
        conn.sendall(b"\x00\x00\x00\x08\x04\xd2\x16\x2f")  # libpq's SSLRequest: a server answers S or N
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.recv(1)
    with pytest.raises(psycopg.OperationalError, match="timeout"):
        psycopg.connect(dead_postgres_url, connect_timeout=2)
