"""The job store's rows (app/jobs/db.py) on SQLite and on a real PostgreSQL: admission,
idempotency, leases, the fenced commit, release, cancel, delete, retention, migrations and
an unreachable database."""
import hashlib
import io
import socket
import threading
import time

import numpy as np
import pytest
import sqlalchemy as sa

from app.core.errors import BlockgradError
from app.jobs import db
from app.jobs.settings import JobSettings

NOW = 1_000_000.0


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/data/jobs.sqlite3"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def engine(store_url):
    engine = db.open_store(store_url)
    yield engine
    engine.dispose()


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


VECTORS = np.arange(12, dtype=np.float64).reshape(4, 3)


def new_job(engine, job_id: str, key: str | None = None, created_at: float = NOW, request_hash: str | None = None,
            result_bytes: int = 128, **limits):
    """`limits`: JobSettings fields (max_jobs, max_job_results_bytes, max_job_records, job_ttl_s)."""
    row = {"id": job_id, "n": 4, "dim": 3, "factor": 2, "objective": "sum_of_squares", "offset": 0.5,
           "dtype": "float64", "outputs": ["accumulated", "losses"], "blocks_total": 4, "result_bytes": result_bytes,
           "idempotency_key": key, "request_hash": request_hash, "created_at": created_at}
    return db.insert_job(engine, row, npy(VECTORS), JobSettings(**limits))


def code_of(call) -> str:
    with pytest.raises(BlockgradError) as caught:
        call()
    return caught.value.code


def test_a_job_is_stored_queued_with_its_input(engine):
    record, created = new_job(engine, "a" * 32)
    assert created and record["status"] == "queued" and record["attempts"] == 0
    assert record["outputs"] == ["accumulated", "losses"] and record["offset"] == 0.5
    assert db.get_job(engine, "a" * 32) == record
    np.testing.assert_array_equal(db.load_input(engine, "a" * 32), VECTORS)
    assert db.get_job(engine, "b" * 32) is None


def test_an_idempotency_key_names_one_job_and_admission_counts_active_jobs(engine):
    first, _ = new_job(engine, "a" * 32, key="k")
    again, created = new_job(engine, "b" * 32, key="k")
    assert not created and again["id"] == "a" * 32 and db.get_job(engine, "b" * 32) is None
    new_job(engine, "c" * 32, max_jobs=2)
    assert code_of(lambda: new_job(engine, "d" * 32, max_jobs=2)) == "overloaded"
    db.cancel_job(engine, "c" * 32, NOW)  # no longer active: room again
    assert new_job(engine, "d" * 32, max_jobs=2)[1]


def test_a_claim_is_exclusive_until_its_lease_expires(engine):
    new_job(engine, "a" * 32)
    assert db.claimable(engine, NOW, 10) == ["a" * 32]
    assert db.claim(engine, "a" * 32, "one", NOW, 10, 3) == 1
    assert db.claim(engine, "a" * 32, "two", NOW + 5, 10, 3) is None
    assert db.claimable(engine, NOW + 5, 10) == []
    assert db.renew(engine, "a" * 32, "one", 1, NOW + 5, 10, 2)  # lease now ends at NOW + 15
    assert db.claim(engine, "a" * 32, "two", NOW + 14, 10, 3) is None
    assert db.claim(engine, "a" * 32, "two", NOW + 16, 10, 3) == 2  # expired: taken over
    record = db.get_job(engine, "a" * 32)
    assert (record["owner"], record["attempts"], record["blocks_done"], record["started_at"]) == ("two", 2, 0, NOW)
    assert not db.renew(engine, "a" * 32, "one", 1, NOW + 16, 10, 3)  # the first runner learns it lost it


def test_one_result_is_committed_fenced_on_owner_and_attempt(engine, monkeypatch):
    monkeypatch.setattr(db, "RESULT_CHUNK_BYTES", 2 * 3 * 8)  # two rows a chunk: several chunks
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    db.claim(engine, "a" * 32, "two", NOW + 11, 10, 3)
    losses = np.array([[1.5, -0.0], [np.pi, 2.0]])
    assert not db.finish_job(engine, "a" * 32, "one", 1, NOW + 12, {"accumulated": VECTORS * 2}, None)
    assert not db.finish_job(engine, "a" * 32, "two", 1, NOW + 12, {"accumulated": VECTORS * 2}, None)
    assert db.get_job(engine, "a" * 32)["status"] == "running"
    assert db.finish_job(engine, "a" * 32, "two", 2, NOW + 12, {"accumulated": VECTORS, "losses": losses}, None)
    assert not db.finish_job(engine, "a" * 32, "two", 2, NOW + 13, {"accumulated": VECTORS}, None)  # once
    record = db.get_job(engine, "a" * 32)
    assert (record["status"], record["blocks_done"], record["finished_at"]) == ("succeeded", 4, NOW + 12)
    chunks = list(db.result_chunks(engine, record, "accumulated"))
    assert [len(chunk) for chunk in chunks] == [2, 2]
    np.testing.assert_array_equal(np.concatenate(chunks), VECTORS)
    stored = np.concatenate(list(db.result_chunks(engine, record, "losses")))
    assert stored.tobytes() == losses.tobytes()  # bit for bit, -0.0 included
    assert db.load_input(engine, "a" * 32) is None  # a finished job's input is not kept


def test_a_failed_job_keeps_its_error_and_no_result(engine):
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    error = {"code": "non_finite_result", "message": "m", "details": {"block": [0, 1]}}
    assert db.finish_job(engine, "a" * 32, "one", 1, NOW, None, error)
    record = db.get_job(engine, "a" * 32)
    assert record["status"] == "failed" and record["error"] == error
    assert list(db.result_chunks(engine, record, "accumulated")) == []


def test_a_lost_attempt_is_submitted_again_until_attempts_run_out(engine):
    new_job(engine, "a" * 32)
    attempt = db.claim(engine, "a" * 32, "one", NOW, 10, 2)
    assert db.claim(engine, "a" * 32, "one", NOW, 10, 2, held=attempt + 1) is None  # not the attempt it holds
    attempt = db.claim(engine, "a" * 32, "one", NOW, 10, 2, held=attempt)
    assert attempt == 2
    assert db.claim(engine, "a" * 32, "one", NOW, 10, 2, held=attempt) is None
    record = db.get_job(engine, "a" * 32)
    assert record["status"] == "failed" and record["error"]["code"] == "job_attempts_exhausted"
    assert record["attempts"] == 2 and record["finished_at"] == NOW


def test_a_released_job_is_queued_again_without_spending_an_attempt(engine):
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    db.renew(engine, "a" * 32, "one", 1, NOW, 10, 3)
    db.release(engine, "a" * 32, "one", 1)
    record = db.get_job(engine, "a" * 32)
    assert (record["status"], record["attempts"], record["owner"], record["blocks_done"]) == ("queued", 0, None, 0)
    assert db.claim(engine, "a" * 32, "two", NOW, 10, 3) == 1


def test_cancel_ends_the_attempt_and_delete_forgets_everything(engine):
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    record = db.cancel_job(engine, "a" * 32, NOW + 1)
    assert (record["status"], record["finished_at"], record["owner"]) == ("cancelled", NOW + 1, None)
    assert not db.renew(engine, "a" * 32, "one", 1, NOW + 2, 10, 1)
    assert not db.finish_job(engine, "a" * 32, "one", 1, NOW + 2, {"accumulated": VECTORS}, None)
    assert db.cancel_job(engine, "a" * 32, NOW + 3)["finished_at"] == NOW + 1  # idempotent
    assert db.delete_job(engine, "a" * 32) and not db.delete_job(engine, "a" * 32)
    assert db.get_job(engine, "a" * 32) is None and db.cancel_job(engine, "a" * 32, NOW) is None
    with engine.connect() as conn:
        for table in (db.jobs, db.inputs, db.results):
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0


def succeed(engine, job_id: str, finished_at: float, result_bytes: int = 128, **limits) -> None:
    new_job(engine, job_id, created_at=finished_at, result_bytes=result_bytes, **limits)
    db.claim(engine, job_id, "one", finished_at, 10, 3)
    db.finish_job(engine, job_id, "one", 1, finished_at, {"accumulated": VECTORS}, None)


def test_sweep_deletes_expired_jobs_only_in_short_batches(engine, monkeypatch):
    monkeypatch.setattr(db, "SWEEP_BATCH", 2)
    for k, job_id in enumerate("abc"):
        succeed(engine, job_id * 32, NOW + k)
    succeed(engine, "d" * 32, NOW + 60, result_bytes=1 << 30)  # within its TTL: kept, however large
    new_job(engine, "e" * 32, created_at=NOW)  # queued jobs never expire
    assert db.sweep(engine, NOW + 70, 30) == 3  # a, b, c finished over 30 s ago, in two transactions
    assert [db.get_job(engine, x * 32) is not None for x in "abcde"] == [False, False, False, True, True]


def test_results_kept_or_reserved_are_capped_and_nothing_within_its_ttl_is_evicted(engine):
    """BLOCKGRAD_MAX_JOB_RESULTS_BYTES counts succeeded results and active jobs' reservations:
    past it a POST is refused (503, retry later) and the kept results survive; expired ones
    make room, oldest first, without waiting for the sweep."""
    limits = {"max_job_results_bytes": 300, "job_ttl_s": 30}
    succeed(engine, "a" * 32, NOW, result_bytes=100, **limits)  # the victim
    new_job(engine, "b" * 32, created_at=NOW, result_bytes=150, **limits)  # queued: reserved
    error = pytest.raises(BlockgradError, new_job, engine, "c" * 32, created_at=NOW + 10, result_bytes=51,
                          **limits).value
    assert error.code == "overloaded" and error.retry_after_s
    assert error.details == {"limit": "BLOCKGRAD_MAX_JOB_RESULTS_BYTES", "value": 301, "allowed": 300}
    assert db.get_job(engine, "a" * 32)["status"] == "succeeded" and db.get_job(engine, "c" * 32) is None
    assert new_job(engine, "c" * 32, created_at=NOW + 10, result_bytes=50, **limits)[1]  # exactly full
    db.cancel_job(engine, "b" * 32, NOW + 10)  # a cancelled job holds nothing
    assert new_job(engine, "d" * 32, created_at=NOW + 20, result_bytes=150, **limits)[1]
    assert code_of(lambda: new_job(engine, "e" * 32, created_at=NOW + 29, result_bytes=1, **limits)) == "overloaded"
    assert new_job(engine, "e" * 32, created_at=NOW + 31, result_bytes=100, **limits)[1]  # a expired: it went
    assert db.get_job(engine, "a" * 32) is None and db.result_chunk(engine, "a" * 32, "accumulated", 0) is None


def test_finished_records_are_capped_the_oldest_expired_going_first(engine):
    limits = {"max_job_records": 3, "job_ttl_s": 30}
    for k, job_id in enumerate("abc"):
        succeed(engine, job_id * 32, NOW + k, **limits)
    error = pytest.raises(BlockgradError, new_job, engine, "d" * 32, created_at=NOW + 30, **limits).value
    assert error.code == "overloaded" and error.retry_after_s  # a finished exactly 30 s ago: not expired
    assert error.details == {"limit": "BLOCKGRAD_MAX_JOB_RECORDS", "value": 3, "allowed": 3}
    assert new_job(engine, "d" * 32, created_at=NOW + 30.5, **limits)[1]  # a, the oldest, expired and went
    assert [db.get_job(engine, x * 32) is not None for x in "abcd"] == [False, True, True, True]
    new_job(engine, "e" * 32, created_at=NOW + 30.5, **limits)  # active jobs are not records yet


def test_concurrent_posts_never_pass_max_jobs(engine):
    """40 inserts released together against BLOCKGRAD_MAX_JOBS = 16: exactly 16 stored, 24 refused."""
    start, codes = threading.Barrier(40), []

    def insert(number):
        start.wait(timeout=60)
        try:
            codes.append("stored" if new_job(engine, f"{number:032x}", max_jobs=16)[1] else "known")
        except BlockgradError as error:
            codes.append(error.code)
    threads = [threading.Thread(target=insert, args=(number,)) for number in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(codes).count("stored") == 16 and codes.count("overloaded") == 24, codes
    assert db.status_counts(engine)["queued"] == 16


def test_sqlite_reuses_the_space_of_expired_results(tmp_path):
    engine = db.open_store(f"sqlite:///{tmp_path}/jobs.sqlite3")
    big = np.ones((512, 512))  # 2 MiB a result
    sizes = []
    for k in range(6):
        new_job(engine, f"{k:032x}", created_at=NOW + k)
        db.claim(engine, f"{k:032x}", "one", NOW + k, 10, 3)
        db.finish_job(engine, f"{k:032x}", "one", 1, NOW + k, {"accumulated": big}, None)
        db.sweep(engine, NOW + k + 1, 0.5)  # each result expires before the next
        with engine.connect() as conn:
            sizes.append(conn.exec_driver_sql("PRAGMA page_count").scalar())
    assert max(sizes[1:]) <= sizes[0] + 8, sizes  # the store does not grow with history


def test_status_counts_and_the_runners_heartbeat(engine):
    new_job(engine, "a" * 32)
    new_job(engine, "b" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    db.renew(engine, "a" * 32, "one", 1, NOW, 10, 3)
    counts = db.status_counts(engine)
    assert (counts["queued"], counts["running"], counts["succeeded"], counts["blocks_done"]) == (1, 1, 0, 3)
    assert db.cluster_workers(engine, NOW) == 0
    db.beat(engine, "one", "tcp://127.0.0.1:1", 2, NOW)
    db.beat(engine, "two", "tcp://127.0.0.1:1", 3, NOW)
    db.beat(engine, "one", "tcp://127.0.0.1:1", 4, NOW + 1)
    assert db.cluster_workers(engine, NOW + 1) == 4
    assert db.cluster_workers(engine, NOW + 1 + db.RUNNER_SEEN_S + 1) == 0  # runners not seen lately


def test_migrations_run_once_under_the_lock_and_only_add(store_url, monkeypatch):
    step = []
    added = sa.Table("jobs_extra", sa.MetaData(), sa.Column("job_id", sa.String(32)))
    monkeypatch.setattr(db, "MIGRATIONS", [*db.MIGRATIONS, lambda conn: (step.append(1), added.create(conn))])
    engines, errors = [], []

    def start():
        try:
            engines.append(db.open_store(store_url))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(engines) == 4 and step == [1]
    with engines[0].connect() as conn:
        assert conn.execute(sa.select(db.versions.c.version)).scalars().all() == [len(db.MIGRATIONS)]
    new_job(engines[0], "a" * 32)  # the previous release's statements still work
    for engine in engines:
        engine.dispose()


def test_a_store_of_version_1_gets_request_hash_and_its_jobs_still_answer(store_url, monkeypatch):
    """A database made by the first release, a job in it with a key: migrated, the key's job is
    returned whatever the request (nothing to compare with), and a new key is checked."""
    monkeypatch.setattr(db, "MIGRATIONS", db.MIGRATIONS[:1])
    first = db.open_store(store_url)
    assert "request_hash" not in {c["name"] for c in sa.inspect(first).get_columns("jobs")}
    with first.begin() as conn:  # what the first release inserted: no request_hash
        conn.execute(db.jobs.insert().values(
            id="a" * 32, status="queued", n=4, dim=3, factor=2, objective="sum_of_squares", offset=0.5,
            dtype="float64", outputs="accumulated,losses", idempotency_key=hashlib.sha256(b"old").hexdigest(),
            blocks_total=4, result_bytes=128, created_at=NOW))
    first.dispose()
    monkeypatch.undo()
    engine = db.open_store(store_url)
    assert "request_hash" in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}
    assert db.get_job(engine, "a" * 32)["request_hash"] is None
    again, created = new_job(engine, "b" * 32, key="old", request_hash="h")
    assert not created and again["id"] == "a" * 32
    assert new_job(engine, "c" * 32, key="new", request_hash="h")[1]
    assert code_of(lambda: new_job(engine, "d" * 32, key="new", request_hash="other")) == "idempotency_key_reused"
    engine.dispose()


def test_a_key_reused_with_another_request_is_refused_and_inserts_nothing(engine):
    first, _ = new_job(engine, "a" * 32, key="k", request_hash="h")
    again, created = new_job(engine, "b" * 32, key="k", request_hash="h")
    assert not created and again == first
    assert code_of(lambda: new_job(engine, "c" * 32, key="k", request_hash="other")) == "idempotency_key_reused"
    assert db.get_job(engine, "c" * 32) is None and db.status_counts(engine)["queued"] == 1


@pytest.mark.parametrize("hashes", [["h"] * 6, ["h", "i", "j", "k", "l", "m"]])
def test_concurrent_inserts_with_one_key_make_one_job(engine, hashes):
    """All released at once: one job; the requests unlike the one stored are refused."""
    start, outcomes = threading.Barrier(len(hashes)), {}

    def insert(number, request_hash):
        start.wait(timeout=60)
        try:
            outcomes[number] = new_job(engine, f"{number:032x}", key="k", request_hash=request_hash)[0]["id"]
        except BlockgradError as error:
            outcomes[number] = error.code
    threads = [threading.Thread(target=insert, args=pair) for pair in enumerate(hashes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == len(hashes) and db.status_counts(engine)["queued"] == 1
    (winner,) = (number for number, outcome in outcomes.items() if outcome == f"{number:032x}")
    for number, outcome in outcomes.items():
        same = hashes[number] == hashes[winner]
        assert outcome == (f"{winner:032x}" if same else "idempotency_key_reused"), outcomes


def test_a_locked_sqlite_store_is_unavailable_not_hung(tmp_path):
    url = f"sqlite:///{tmp_path}/jobs.sqlite3"
    engine, holder = db.open_store(url), db.open_store(url)
    with holder.begin():  # BEGIN IMMEDIATE: the write lock, held
        assert code_of(lambda: new_job(engine, "a" * 32)) == "store_unavailable"


def test_an_unreachable_postgresql_is_unavailable():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once closed
    assert code_of(lambda: db.open_store(f"postgresql://blockgrad@127.0.0.1:{port}/jobs")) == "store_unavailable"
    assert db.store_unavailable().retry_after_s > 0


def test_time_is_never_read_by_the_store(engine, monkeypatch):
    """Every function takes `now`: a test's clock is the store's (no sleeping in these tests)."""
    monkeypatch.setattr(time, "time", lambda: pytest.fail("the store read the clock"))
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)


def test_an_idempotency_key_of_any_length_names_one_job(engine):
    key = "k" * 5000  # past PostgreSQL's index entry limit: the store keeps its sha256
    assert new_job(engine, "a" * 32, key=key)[1]
    again, created = new_job(engine, "b" * 32, key=key)
    assert not created and again["id"] == "a" * 32
    assert new_job(engine, "c" * 32, key=key[:-1])[1]


def test_a_delete_waits_for_a_finishing_runner_instead_of_deadlocking(postgres_url, monkeypatch):
    """Every writer locks the job's row first: a DELETE that arrives while the runner's finish
    holds it waits, and both commit (PostgreSQL would abort one of two crossed lock orders)."""
    monkeypatch.setattr(db, "STATEMENT_TIMEOUT_MS", 600_000)  # the DELETE waits for the test, not a clock
    engine = db.open_store(postgres_url)
    new_job(engine, "a" * 32)
    db.claim(engine, "a" * 32, "one", NOW, 10, 3)
    deleted = []
    with engine.begin() as conn:  # the finish's statements, held open at their first one
        assert conn.execute(sa.update(db.jobs).where(db.fence("a" * 32, "one", 1)).values(status="succeeded")).rowcount
        deleter = threading.Thread(target=lambda: deleted.append(db.delete_job(engine, "a" * 32)))
        deleter.start()
        with engine.connect() as probe:  # the DELETE is waiting on the job's row lock
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            for _ in range(600):
                if probe.execute(sa.text(waiting)).scalar():
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the DELETE never waited on the finish's lock")
        conn.execute(db.results.insert().values(job_id="a" * 32, output="accumulated", seq=0, data=b"x"))
        conn.execute(db.inputs.delete().where(db.inputs.c.job_id == "a" * 32))
    deleter.join(60)
    assert deleted == [True] and db.get_job(engine, "a" * 32) is None
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(db.results)).scalar() == 0
    engine.dispose()


def test_a_store_that_goes_away_after_use_is_unavailable_then_back():
    """PostgreSQL stopped under a warm pool: store_unavailable (not a hang, not a 500); started
    again at the same place, the same engine answers."""
    import os
    import signal

    from tests.postgres import running_postgres

    with running_postgres() as server:
        engine = db.open_store(server.get_uri())
        new_job(engine, "a" * 32)
        postmaster = server.get_pid()
        os.kill(postmaster, signal.SIGINT)  # a fast shutdown: every connection is closed
        assert wait_until_gone(postmaster)
        assert code_of(lambda: db.get_job(engine, "a" * 32)) == "store_unavailable"
        assert code_of(lambda: new_job(engine, "b" * 32)) == "store_unavailable"
        server.ensure_postgres_running()
        assert db.get_job(engine, "a" * 32)["status"] == "queued"
        engine.dispose()


def wait_until_gone(pid: int) -> bool:
    import psutil

    for _ in range(1200):
        if not psutil.pid_exists(pid):
            return True
        time.sleep(0.05)
    return False
