"""Finished jobs written straight into a job store, as the runner leaves them: a store with a
history of `count` kept jobs for the tests and the benchmark (test_job_queries.py, bench J6)."""
import secrets
import time


def add_finished_jobs(url: str, count: int) -> list[str]:
    """`count` succeeded 1 x 1 jobs (8-byte losses, no result rows), finished now: their ids."""
    from app.jobs import db

    engine, now = db.open_store(url), time.time()
    rows = [{"id": secrets.token_hex(16), "status": "succeeded", "n": 1, "dim": 1, "factor": 1, "objective": "sum",
             "offset": 0.0, "dtype": "float64", "outputs": "losses", "blocks_total": 1, "blocks_done": 1,
             "result_bytes": 8, "created_at": now, "started_at": now, "finished_at": now, "attempts": 1}
            for _ in range(count)]
    with engine.begin() as conn:
        if rows:
            conn.execute(db.jobs.insert(), rows)
    engine.dispose()
    return [row["id"] for row in rows]
