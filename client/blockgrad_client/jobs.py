"""Jobs (/v1/jobs): submit the vectors as a .npy body, poll the record, fetch the result as
a .npz file, cancel, delete. A submission carries an Idempotency-Key, so that the client's retry of
a POST whose answer was lost returns the same job instead of making a second one."""
import io
import sys
import time
import uuid

import numpy as np

from .errors import BlockgradError

JOBS_PATH = "/v1/jobs"
NPY, NPZ = "application/x-npy", "application/x-npz"
FINISHED = ("succeeded", "failed", "cancelled")
POLL_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # waits between polls, growing
BAR_WIDTH = 30


def npy_body(vectors, dtype: str) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(vectors, dtype=dtype), allow_pickle=False)
    return buffer.getvalue()


def query(fields: dict) -> dict:
    params = {}
    for name, value in fields.items():
        if value is None:
            continue
        params[name] = ",".join(value) if name == "outputs" and not isinstance(value, str) else str(value)
    return params


class Job:
    """One job of the service: `id` is its id (the path's {id}), `record` its last known record."""

    def __init__(self, client, record: dict):
        self.client = client
        self.record = record
        self.id = record["id"]

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.record.get('status', 'unknown')}>"

    @property
    def path(self) -> str:
        return f"{JOBS_PATH}/{self.id}"

    def status(self) -> str:
        """queued, running, succeeded, failed or cancelled (GET /v1/jobs/{id})."""
        self.record = self.client.get_json(self.path)
        return self.record["status"]

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict:
        """Poll until the job has finished (any way); its record. `progress`: a bar on stderr.
        Past `timeout` seconds: BlockgradError `timeout` (the job runs on)."""
        end = None if timeout is None else time.monotonic() + timeout
        polls = 0
        while self.status() not in FINISHED:
            if progress:
                draw_bar(self.record)
            wait = POLL_S[min(polls, len(POLL_S) - 1)]
            if end is not None and time.monotonic() + wait > end:
                raise BlockgradError("timeout", f"Job {self.id} is still {self.record['status']} after {timeout:g} s.")
            time.sleep(wait)
            polls += 1
        if progress:
            draw_bar(self.record)
            sys.stderr.write("\n")
        return self.record

    def result(self) -> dict[str, np.ndarray]:
        """The outputs asked for and `bounds`, as numpy arrays (the binary form); BlockgradError
        job_not_done before the job has succeeded."""
        with self.client.request("GET", self.path + "/result", headers={"Accept": NPZ}) as response:
            data = response.content
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return {name: arrays[name] for name in arrays.files}

    def cancel(self) -> dict:
        """Cancel a queued or running job: its record, status cancelled (again for a cancelled
        one); BlockgradError job_done for a job that has succeeded or failed."""
        with self.client.request("POST", self.path + "/cancel") as response:
            self.record = response.json()
            return self.record

    def delete(self) -> None:
        """Forget the job, with its result (cancelled first if it runs); its routes are then 404."""
        with self.client.request("DELETE", self.path):
            pass


def draw_bar(record: dict) -> None:
    done, total = record["progress"]["blocks_done"], max(1, record["progress"]["blocks_total"])
    filled = BAR_WIDTH * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} blocks {record['status']:<9}")
    sys.stderr.flush()


def submit_job(client, vectors, *, idempotency_key: str | None = None, dtype: str = "float32", **fields) -> Job:
    """POST /v1/jobs with the vectors as a .npy body (shape (N, D), `dtype`) and the other
    fields (factor, objective, offset, outputs) as query parameters."""
    headers = {"Content-Type": NPY, "Idempotency-Key": idempotency_key or uuid.uuid4().hex}
    with client.request("POST", JOBS_PATH, params=query(fields), data=npy_body(vectors, dtype),
                        headers=headers) as response:
        return Job(client, response.json())
