"""The job store: every job's record, input and result in one database, the source of truth
(docs/jobs.md). SQLite under BLOCKGRAD_DATA_DIR, or PostgreSQL (BLOCKGRAD_JOBS_DB), through
SQLAlchemy Core: one SQL text for both, a pool, timeouts.

Web workers insert, read, cancel and delete rows; the job runner (runner.py) claims a job
with a lease, renews it, and commits its result fenced on (owner, attempt), so that of two
runners sharing one database at most one finishes a job. Every function answers
store_unavailable when the database does not answer within its timeouts.
"""
import io
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps
from hashlib import sha256

import numpy as np
import sqlalchemy as sa
from sqlalchemy import and_, event, exc, func, or_, select

from ..core.errors import (idempotency_key_reused, job_attempts_exhausted, records_full, results_full,
                           store_unavailable, too_many_jobs)

TIMEOUT_S = 2  # connecting, a pool checkout, a locked SQLite: a job route still answers within 5 s
STATEMENT_TIMEOUT_MS = 2000
# A server that vanishes mid-connection (a partition, a lost node) is noticed within seconds too.
TCP_ARGS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 2,
            "tcp_user_timeout": 4000}
RESULT_CHUNK_BYTES = 1024 * 1024  # whole rows of an output per stored chunk: a download holds a few
# Each SQLite connection's page cache: results are read once, in order, so a large cache only
# makes every concurrent download hold more (SQLite's default is 2 MiB).
SQLITE_CACHE_BYTES = 512 * 1024
# PostgreSQL connections per process, at most 5: a pod's 2 web workers and its runner hold 15,
# and deploy/k8s/postgres.yaml's max_connections (300) covers every replica the autoscalers allow.
POOL_SIZE, POOL_OVERFLOW = 2, 3
RUNNER_SEEN_S = 60.0  # a runner not seen for this long no longer counts (cluster_workers)
SWEEP_BATCH = 100  # expired jobs one transaction deletes at most: each stays short
MIGRATION_LOCK, ADMISSION_LOCK = 29_001, 29_002  # PostgreSQL advisory locks
ACTIVE = ("queued", "running")
FINISHED = ("succeeded", "failed", "cancelled")

meta = sa.MetaData()


def first_job_columns() -> list[sa.Column]:
    """The jobs table as migration step 1 made it (later steps add the other columns)."""
    return [
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        *(sa.Column(name, sa.Integer, nullable=False) for name in ("n", "dim", "factor")),
        sa.Column("objective", sa.Text, nullable=False),
        sa.Column("offset", sa.Float, nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("outputs", sa.Text, nullable=False),  # comma-joined
        sa.Column("idempotency_key", sa.Text, unique=True),
        *(sa.Column(name, sa.BigInteger, nullable=False) for name in ("blocks_total", "result_bytes")),
        sa.Column("blocks_done", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float, index=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("owner", sa.Text),
        sa.Column("lease_until", sa.Float),
        sa.Column("error", sa.Text)]  # JSON {code, message, details}


jobs = sa.Table("jobs", meta, *first_job_columns(),
                sa.Column("request_hash", sa.String(64)),  # sha256 of the job's vectors and fields (store.submit)
                sa.Column("traceparent", sa.String(55)))  # the POST's W3C traceparent, None when not traced
inputs = sa.Table(
    "job_inputs", meta,
    sa.Column("job_id", sa.String(32), primary_key=True),
    sa.Column("vectors", sa.LargeBinary, nullable=False))  # .npy bytes, the job's dtype
results = sa.Table(
    "job_results", meta,
    sa.Column("job_id", sa.String(32), primary_key=True),
    sa.Column("output", sa.String(16), primary_key=True),  # accumulated (N, D) or losses (F, F)
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False))  # whole rows, C order
runners = sa.Table(
    "job_runners", meta,
    sa.Column("owner", sa.Text, primary_key=True),
    sa.Column("scheduler", sa.Text),
    sa.Column("workers", sa.Integer, nullable=False),
    sa.Column("seen_at", sa.Float, nullable=False))
versions = sa.Table("schema_version", meta, sa.Column("version", sa.Integer, nullable=False))

# Each step only adds (a table, a nullable or defaulted column): the previous release's
# readers keep working against the newer schema during a rolling upgrade.
MIGRATIONS = [
    lambda conn: (sa.Table("jobs", sa.MetaData(), *first_job_columns()).create(conn),
                  meta.create_all(conn, tables=[inputs, results, runners])),
    lambda conn: conn.execute(sa.text("ALTER TABLE jobs ADD COLUMN request_hash VARCHAR(64)")),
    # admit's counts read this index alone, whatever the table's width
    lambda conn: conn.execute(sa.text("CREATE INDEX ix_jobs_status_bytes ON jobs (status, result_bytes)")),
    lambda conn: conn.execute(sa.text("ALTER TABLE jobs ADD COLUMN traceparent VARCHAR(55)")),
]


def guarded(function):
    """The database unreachable, too slow or locked: store_unavailable (503, Retry-After)."""
    @wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (exc.OperationalError, exc.InterfaceError, exc.TimeoutError):
            raise store_unavailable() from None
    return call


def sqlite_connection(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event starts every transaction
    dbapi_connection.execute(f"PRAGMA cache_size = -{SQLITE_CACHE_BYTES // 1024}")  # in KiB when negative
    # WAL: readers never wait for the writer. Switching to it ignores the busy timeout: while another
    # process creates the file (a service's workers and runner start together) it is refused at once.
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def sqlite_begin(conn) -> None:
    """A writer takes the write lock at its start (no deadlock upgrading a read lock); a reader
    (`reading`) takes none."""
    conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("reading") else "BEGIN IMMEDIATE")


@contextmanager
def reading(engine: sa.Engine):
    with engine.connect().execution_options(reading=True) as conn, conn.begin():
        yield conn


@guarded
def open_store(url: str, application: str = "blockgrad") -> sa.Engine:
    """An engine on the store, its schema brought up to date. Never shared across a fork.
    `application`: PostgreSQL's application_name (pg_stat_activity, logs): who is connected."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    if url.startswith("sqlite"):
        os.makedirs(os.path.dirname(sa.make_url(url).database) or ".", exist_ok=True)
        engine = sa.create_engine(url, pool_timeout=TIMEOUT_S,
                                  connect_args={"timeout": TIMEOUT_S, "check_same_thread": False})
        event.listen(engine, "connect", sqlite_connection)
        event.listen(engine, "begin", sqlite_begin)
    else:
        engine = sa.create_engine(url, pool_pre_ping=True, pool_timeout=TIMEOUT_S, pool_size=POOL_SIZE,
                                  max_overflow=POOL_OVERFLOW, connect_args={
            "connect_timeout": TIMEOUT_S, "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
            "application_name": application, **TCP_ARGS})
    migrate(engine)
    return engine


def migrate(engine: sa.Engine) -> None:
    """Run the steps this database lacks, under a lock: pods starting together do not race."""
    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE is the lock
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        versions.create(conn, checkfirst=True)
        done = conn.execute(select(func.max(versions.c.version))).scalar() or 0
        for step in MIGRATIONS[done:]:
            step(conn)
        if len(MIGRATIONS) > done:
            conn.execute(versions.delete())
            conn.execute(versions.insert().values(version=len(MIGRATIONS)))


def as_record(row) -> dict | None:
    if row is None:
        return None
    record = dict(row._mapping)
    record["outputs"] = record["outputs"].split(",")
    record["error"] = json.loads(record["error"]) if record["error"] else None
    return record


def by_key(conn, key: str, request_hash: str | None) -> dict:
    """The job this key made; idempotency_key_reused if it came with another request (a job
    stored before request_hash was: its job)."""
    known = as_record(conn.execute(select(jobs).where(jobs.c.idempotency_key == key)).first())
    if known is not None and known["request_hash"] not in (None, request_hash):
        raise idempotency_key_reused()
    return known


def held_counts(conn) -> tuple[int, int, int]:
    """(active jobs, result bytes kept or reserved, finished records kept): one scan of the
    (status, result_bytes) index, which grows by about 0.05 ms per 1,000 jobs kept."""
    totals = dict.fromkeys((*ACTIVE, *FINISHED), (0, 0)) | {status: (count, nbytes) for status, count, nbytes in
                                                           conn.execute(select(jobs.c.status, func.count(), func.sum(
                                                               jobs.c.result_bytes)).group_by(jobs.c.status))}
    return (sum(totals[status][0] for status in ACTIVE), sum(totals[status][1] for status in (*ACTIVE, "succeeded")),
            sum(totals[status][0] for status in FINISHED))


def admit(conn, nbytes: int, now: float, settings) -> None:
    """Room for a job whose result takes `nbytes`, or the limit's error. Nothing still within
    its TTL is ever deleted to make room; expired records (the sweep's) go first, oldest first."""
    active, held, kept = held_counts(conn)
    if active >= settings.max_jobs:
        raise too_many_jobs(active, settings.max_jobs)
    if (held + nbytes > settings.max_job_results_bytes or kept >= settings.max_job_records) and \
            delete_expired(conn, now - settings.job_ttl_s):
        active, held, kept = held_counts(conn)
    if held + nbytes > settings.max_job_results_bytes:
        raise results_full(held, nbytes, settings.max_job_results_bytes)
    if kept >= settings.max_job_records:
        raise records_full(kept, settings.max_job_records)


@guarded
def insert_job(engine: sa.Engine, row: dict, vectors_npy: bytes, settings) -> tuple[dict, bool]:
    """A new job, queued, with its input: (its record, True); the job a known Idempotency-Key
    made with the same request (row's request_hash): (that record, False); with another,
    idempotency_key_reused. `settings` (JobSettings): the limits `admit` applies, atomically
    with the insert (PostgreSQL: under an advisory lock; SQLite: BEGIN IMMEDIATE)."""
    # Stored as its sha256: a key of any length fits PostgreSQL's index.
    key = row.get("idempotency_key") and sha256(row["idempotency_key"].encode()).hexdigest()
    row = {**row, "idempotency_key": key}
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":  # the counts and the insert, one POST at a time
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK})
            known = by_key(conn, key, row.get("request_hash")) if key else None
            if known is not None:
                return known, False
            admit(conn, row["result_bytes"], row["created_at"], settings)
            conn.execute(jobs.insert().values(**{**row, "outputs": ",".join(row["outputs"])}, status="queued"))
            conn.execute(inputs.insert().values(job_id=row["id"], vectors=vectors_npy))
            return as_record(conn.execute(select(jobs).where(jobs.c.id == row["id"])).first()), True
    except exc.IntegrityError:  # the same key's POST committed first
        with engine.begin() as conn:
            return by_key(conn, key, row.get("request_hash")), False


@guarded
def get_job(engine: sa.Engine, job_id: str) -> dict | None:
    with reading(engine) as conn:
        return as_record(conn.execute(select(jobs).where(jobs.c.id == job_id)).first())


@guarded
def cancel_job(engine: sa.Engine, job_id: str, now: float) -> dict | None:
    """Queued or running: cancelled (its runner sees it at its next renewal). The record after."""
    with engine.begin() as conn:
        ended = conn.execute(sa.update(jobs).where(jobs.c.id == job_id, jobs.c.status.in_(ACTIVE)).values(
            status="cancelled", finished_at=now, owner=None, lease_until=None)).rowcount
        if ended:
            conn.execute(inputs.delete().where(inputs.c.job_id == job_id))
        return as_record(conn.execute(select(jobs).where(jobs.c.id == job_id)).first())


def delete_rows(conn, job_ids: list[str]) -> None:
    # The job's row first, as every writer locks it first: no deadlock with a finishing runner.
    for table, column in ((jobs, jobs.c.id), (inputs, inputs.c.job_id), (results, results.c.job_id)):
        conn.execute(table.delete().where(column.in_(job_ids)))


@guarded
def delete_job(engine: sa.Engine, job_id: str) -> bool:
    with engine.begin() as conn:
        known = conn.execute(select(jobs.c.id).where(jobs.c.id == job_id)).first() is not None
        delete_rows(conn, [job_id])
        return known


@guarded
def status_counts(engine: sa.Engine) -> dict[str, int]:
    """Jobs by status (a scan of the status index alone), and the blocks done of the active ones
    (their rows only)."""
    counts = dict.fromkeys((*ACTIVE, *FINISHED), 0)
    with reading(engine) as conn:
        counts.update(conn.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status)).all())
        counts["blocks_done"] = conn.execute(select(func.coalesce(func.sum(jobs.c.blocks_done), 0)).where(
            jobs.c.status.in_(ACTIVE))).scalar()
    return counts


def claimable_now(now: float):
    return or_(jobs.c.status == "queued",
               and_(jobs.c.status == "running", or_(jobs.c.lease_until.is_(None), jobs.c.lease_until < now)))


@guarded
def claimable(engine: sa.Engine, now: float, limit: int) -> list[str]:
    """Queued jobs and running ones whose runner stopped renewing, oldest first."""
    with reading(engine) as conn:
        return list(conn.execute(select(jobs.c.id).where(claimable_now(now)).order_by(jobs.c.created_at)
                                 .limit(limit)).scalars())


@guarded
def claim(engine: sa.Engine, job_id: str, owner: str, now: float, lease_s: float, max_attempts: int,
          held: int | None = None) -> int | None:
    """The job's next attempt, this owner's until its lease expires: its number; None if
    another runner has it. `held`: the attempt this owner holds and lost (its graph gone):
    submitted again under a new number. After max_attempts the job fails
    job_attempts_exhausted (None)."""
    which = claimable_now(now) if held is None else and_(
        jobs.c.owner == owner, jobs.c.attempts == held, jobs.c.status == "running")
    with engine.begin() as conn:
        error = json.dumps(job_attempts_exhausted(max_attempts).as_dict())
        if conn.execute(sa.update(jobs).where(jobs.c.id == job_id, which, jobs.c.attempts >= max_attempts).values(
                status="failed", error=error, finished_at=now, owner=None, lease_until=None)).rowcount:
            conn.execute(inputs.delete().where(inputs.c.job_id == job_id))
            return None
        return conn.execute(sa.update(jobs).where(jobs.c.id == job_id, which).values(
            status="running", owner=owner, lease_until=now + lease_s, attempts=jobs.c.attempts + 1, blocks_done=0,
            started_at=func.coalesce(jobs.c.started_at, now)).returning(jobs.c.attempts)).scalar()


def fence(job_id: str, owner: str, attempt: int):
    return and_(jobs.c.id == job_id, jobs.c.owner == owner, jobs.c.attempts == attempt, jobs.c.status == "running")


@guarded
def load_input(engine: sa.Engine, job_id: str) -> np.ndarray | None:
    with reading(engine) as conn:
        data = conn.execute(select(inputs.c.vectors).where(inputs.c.job_id == job_id)).scalar()
    return None if data is None else np.load(io.BytesIO(data), allow_pickle=False)


@guarded
def renew(engine: sa.Engine, job_id: str, owner: str, attempt: int, now: float, lease_s: float,
          blocks_done: int) -> bool:
    """The lease extended and the progress written; False: no longer this attempt's job."""
    with engine.begin() as conn:
        return conn.execute(sa.update(jobs).where(fence(job_id, owner, attempt)).values(
            lease_until=now + lease_s, blocks_done=blocks_done)).rowcount == 1


@guarded
def finish_job(engine: sa.Engine, job_id: str, owner: str, attempt: int, now: float,
               arrays: dict[str, np.ndarray] | None, error: dict | None) -> bool:
    """The result's rows and the job's end in one transaction, fenced on (owner, attempt):
    a job is succeeded only with its result stored. False: fenced out, nothing written."""
    with engine.begin() as conn:
        succeeded = error is None
        if not conn.execute(sa.update(jobs).where(fence(job_id, owner, attempt)).values(
                status="succeeded" if succeeded else "failed", finished_at=now, owner=None, lease_until=None,
                error=None if succeeded else json.dumps(error),
                **({"blocks_done": jobs.c.blocks_total} if succeeded else {}))).rowcount:
            return False
        for output, array in (arrays or {}).items():  # whole rows per chunk
            rows = max(1, RESULT_CHUNK_BYTES // max(1, array[:1].nbytes))
            for seq, start in enumerate(range(0, array.shape[0], rows)):
                conn.execute(results.insert().values(job_id=job_id, output=output, seq=seq,
                                                     data=np.ascontiguousarray(array[start:start + rows]).tobytes()))
        conn.execute(inputs.delete().where(inputs.c.job_id == job_id))
        return True


@guarded
def release(engine: sa.Engine, job_id: str, owner: str, attempt: int) -> None:
    """A stopping runner hands its job back, queued; the attempt does not count."""
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(fence(job_id, owner, attempt)).values(
            status="queued", owner=None, lease_until=None, attempts=jobs.c.attempts - 1, blocks_done=0))


def delete_expired(conn, before: float) -> int:
    """At most SWEEP_BATCH jobs finished before `before`, oldest first, deleted: how many."""
    gone = list(conn.execute(select(jobs.c.id).where(jobs.c.finished_at < before)
                             .order_by(jobs.c.finished_at).limit(SWEEP_BATCH)).scalars())
    if gone:
        delete_rows(conn, gone)
    return len(gone)


@guarded
def sweep(engine: sa.Engine, now: float, ttl_s: float) -> int:
    """Finished jobs past their TTL deleted, SWEEP_BATCH per short transaction (their pages are
    reused by later writes). Returns how many went."""
    gone = 0
    while True:
        with engine.begin() as conn:
            deleted = delete_expired(conn, now - ttl_s)
        gone += deleted
        if deleted < SWEEP_BATCH:
            return gone


@guarded
def result_chunk(engine: sa.Engine, job_id: str, output: str, seq: int) -> bytes | None:
    with reading(engine) as conn:
        return conn.execute(select(results.c.data).where(
            results.c.job_id == job_id, results.c.output == output, results.c.seq == seq)).scalar()


def result_chunks(engine: sa.Engine, record: dict, output: str) -> Iterator[np.ndarray]:
    """A succeeded job's output (its record's), whole rows at a time: one short query per
    chunk, no connection held while a client reads. Ends early if the job is deleted meanwhile."""
    columns = record["dim"] if output == "accumulated" else record["factor"]
    seq = 0
    while (data := result_chunk(engine, record["id"], output, seq)) is not None:
        yield np.frombuffer(data, dtype=record["dtype"]).reshape(-1, columns)
        seq += 1


@guarded
def beat(engine: sa.Engine, owner: str, scheduler: str | None, workers: int, now: float) -> None:
    """A runner's heartbeat: what it sees of its cluster."""
    with engine.begin() as conn:
        values = {"scheduler": scheduler, "workers": workers, "seen_at": now}
        if not conn.execute(sa.update(runners).where(runners.c.owner == owner).values(**values)).rowcount:
            conn.execute(runners.insert().values(owner=owner, **values))
        conn.execute(runners.delete().where(runners.c.seen_at < now - 10 * RUNNER_SEEN_S))


@guarded
def cluster_workers(engine: sa.Engine, now: float) -> int:
    """Dask workers the runners seen lately see (the most any of them sees)."""
    with reading(engine) as conn:
        return conn.execute(select(func.max(runners.c.workers)).where(
            runners.c.seen_at >= now - RUNNER_SEEN_S)).scalar() or 0
