"""Functions run inside the Dask scheduler (Client.run_on_scheduler): one round trip reads
a job's task states or removes its records. Standard library only: the scheduler imports
this module by name."""

JOBS, OUTCOMES, IDEMPOTENCY = "blockgrad-jobs", "blockgrad-outcomes", "blockgrad-idempotency"


def tile_key(job_id: str, index: int) -> str:
    return f"blockgrad-tile-{job_id}-{index}"


def finish_key(job_id: str) -> str:
    return f"blockgrad-finish-{job_id}"


def outcome_key(job_id: str) -> str:
    return f"blockgrad-outcome-{job_id}"


def snapshots(job_ids=None, dask_scheduler=None) -> dict:
    """job id -> {"record", "outcome", "progress"} for these jobs (None: every job)."""
    metadata = dask_scheduler.task_metadata
    records, outcomes = metadata.get(JOBS, {}), metadata.get(OUTCOMES, {})
    found = {}
    for job_id in (list(records) if job_ids is None else job_ids):
        record = records.get(job_id)
        if record is not None:
            found[job_id] = {"record": record, "outcome": outcomes.get(job_id),
                             "progress": job_progress(job_id, record.get("tile_blocks", []), dask_scheduler)}
    return found


def job_progress(job_id: str, tile_blocks: list, dask_scheduler=None) -> dict:
    """Blocks of the tiles finished, whether any tile is processing, the final tasks' states.
    A tile is finished while its result is in memory or a task that consumed it is (a sum, up
    to the outcome): a released tile counts only so; a cancelled or lost one does not."""
    tasks = dask_scheduler.tasks
    finished: dict = {}

    def is_finished(ts) -> bool:
        if ts.key not in finished:
            finished[ts.key] = ts.state == "memory" or any(is_finished(d) for d in ts.dependents)
        return finished[ts.key]

    def state(key):
        ts = tasks.get(key)
        return None if ts is None else ts.state

    outcome, finish = state(outcome_key(job_id)), state(finish_key(job_id))
    done, processing = 0, False
    for index, blocks in enumerate(tile_blocks):
        tile = tasks.get(tile_key(job_id, index))
        processing = processing or (tile is not None and tile.state == "processing")
        if outcome == "memory" or (tile is not None and is_finished(tile)):
            done += blocks
    return {"done": done, "processing": processing, "finish": finish, "outcome": outcome}


def create_record(job_id: str, record: dict, idempotency_key=None, dask_scheduler=None) -> str:
    """A new job's record, unless its Idempotency-Key already names a job: one step of the
    scheduler's event loop, so that two POSTs with the same key make one job. Returns the
    key's job id (this one, when new)."""
    metadata = dask_scheduler.task_metadata
    records = metadata.setdefault(JOBS, {})
    if idempotency_key is not None:
        keys = metadata.setdefault(IDEMPOTENCY, {})
        known = keys.get(idempotency_key)
        if known is not None and known in records:
            return known
        keys[idempotency_key] = job_id
    records[job_id] = record
    return job_id


def forget_records(job_id: str, dask_scheduler=None) -> None:
    metadata = dask_scheduler.task_metadata
    record = metadata.get(JOBS, {}).pop(job_id, None)
    metadata.get(OUTCOMES, {}).pop(job_id, None)
    key = (record or {}).get("idempotency_key")
    if key is not None and metadata.get(IDEMPOTENCY, {}).get(key) == job_id:
        metadata[IDEMPOTENCY].pop(key)


def workers_count(dask_scheduler=None) -> int:
    return len(dask_scheduler.workers)


def cluster_view(dask_scheduler=None) -> dict:
    """Every job's snapshot and the workers, in one round trip (a /metrics scrape)."""
    return {"jobs": snapshots(None, dask_scheduler=dask_scheduler), "workers": workers_count(dask_scheduler)}
