"""Domain errors: what went wrong, as a stable code, a message that says what to
change, and details. No HTTP here: app/http/errors.py maps each code to a status.

Each failure has one constructor below; the code that raises it and the
documentation's example both call it, so the two cannot drift apart.
"""
import heapq
import math
from typing import Any

# A message lists at most this many field names, then "and <count> more": a body with
# millions of unknown keys must not make an error as large as itself.
LISTED_NAMES = 16


class BlockgradError(Exception):
    """A failure a client can act on: {"code", "message", "details"}."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}
        self.retry_after_s = retry_after_s  # set when retrying later may succeed as sent

    def as_dict(self) -> dict[str, Any]:
        """{"code", "message", "details"}: an error body's, and a failed job's `error`."""
        return {"code": self.code, "message": self.message, "details": self.details or {}}


def cut_text(text: str, limit: int = 64) -> str:
    """`text` cut to `limit` characters, saying how many were left out (names, messages, details)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def listed_names(names, count: int) -> str:
    """The first LISTED_NAMES names in sorted order (in O(count)), each cut short, and how many more."""
    shown = [cut_text(name) for name in heapq.nsmallest(LISTED_NAMES, names)]
    more = f" and {count - len(shown)} more" if count > len(shown) else ""
    return ", ".join(shown) + more


def validation_error(fields: dict[str, Any], message: str | None = None) -> BlockgradError:
    """`fields`: field name -> list of messages."""
    names = listed_names(fields, len(fields))
    return BlockgradError("validation_error", message or f"The request is not valid; fix these fields: {names}.",
                          {"fields": fields})


def many_unknown(mapping: object, known) -> set | None:
    """The keys of `mapping` (a dict) not in `known`, when they are more than a message lists;
    else None. O(keys): refused before a schema would spend seconds on millions of them."""
    if not isinstance(mapping, dict) or len(mapping) <= len(known):
        return None
    unknown = mapping.keys() - set(known)
    return unknown if len(unknown) > LISTED_NAMES else None


def unknown_fields(names: set[str], known) -> BlockgradError:
    """Fields the schema does not have, refused before it looks at any of them (costs O(len(names)))."""
    listed = heapq.nsmallest(LISTED_NAMES, names)
    fields: dict[str, Any] = {cut_text(name): ["Unknown field."] for name in listed}
    return BlockgradError("validation_error",
                          f"The request is not valid: unknown fields {listed_names(listed, len(names))}; "
                          f"the fields are {', '.join(known)}.",
                          {"fields": fields, "unknown_fields": len(names)})


def invalid_request(message: str) -> BlockgradError:
    """validation_error with a message only: /v2 answers it as the protocol's {"error": message}."""
    return BlockgradError("validation_error", message)


def not_an_object(messages: list[str]) -> BlockgradError:
    """/v1: the body is JSON but not an object; `messages`: the schema's."""
    return validation_error({"_schema": messages}, "The body must be a JSON object with at least `vectors`.")


def field_error(field: str, message: str) -> BlockgradError:
    return validation_error({field: [message]})


def limit_exceeded(message: str, limit: str, value: int, allowed: int, **extra: Any) -> BlockgradError:
    return BlockgradError("limit_exceeded", message, {"limit": limit, "value": value, "allowed": allowed, **extra})


def non_finite_advice(dtype: str) -> str:
    """What to change; float64 is worth suggesting only to a float32 request."""
    return ("send smaller values, another objective, or dtype float64" if dtype == "float32"
            else "send smaller values or another objective")


def non_finite_block(row: int, col: int, dtype: str) -> BlockgradError:
    return BlockgradError(
        "non_finite_result",
        f"Block (row {row}, col {col}) has a loss or gradient that is not finite in {dtype}; "
        f"{non_finite_advice(dtype)}.",
        {"block": {"row": row, "col": col}})


def non_finite_accumulated(dtype: str) -> BlockgradError:
    return BlockgradError("non_finite_result",
                          f"The accumulated gradient is not finite in {dtype}; {non_finite_advice(dtype)}.",
                          {"output": "accumulated"})


def deadline_exceeded(timeout_s: float, queued: bool = False) -> BlockgradError:
    """`queued`: the deadline passed while the request waited for the compute slot."""
    message = (f"The request waited for the compute slot until its {timeout_s:g} s deadline passed; "
               "the server is busy, retry later." if queued else
               f"The request did not finish within {timeout_s:g} s; retry later, or send a larger factor "
               "or fewer outputs.")
    details = {"timeout_s": timeout_s, **({"queued": True} if queued else {})}
    return BlockgradError("deadline_exceeded", message, details, retry_after_s=max(1, math.ceil(timeout_s / 10)))


def overloaded(queue_depth: int) -> BlockgradError:
    """The compute slot is taken and `queue_depth` requests already wait for it."""
    return BlockgradError(
        "overloaded",
        f"The server is busy: {queue_depth} requests already wait for this worker's compute slot "
        "(BLOCKGRAD_QUEUE_DEPTH); retry after the Retry-After seconds, on any replica.",
        {"queue_depth": queue_depth}, retry_after_s=1)


def client_closed() -> BlockgradError:
    """The client went away; no answer reaches it, the code is for the log and metrics."""
    return BlockgradError("client_closed", "The client closed the connection before the answer was complete.")


def device_out_of_memory() -> BlockgradError:
    return BlockgradError(
        "device_out_of_memory",
        "The compute device ran out of memory on this request; retry later, "
        "or send a larger factor, fewer outputs or fewer vectors.",
        retry_after_s=5)  # the freed memory is the device's again by then


def not_ready(reason: str) -> BlockgradError:
    return BlockgradError("not_ready", f"The compute device is not usable: {reason}")


# Jobs (docs/jobs.md): their codes are in the same table as the others'.
CLUSTER_RETRY_AFTER_S = 5
RETRY_AFTER_S = 2  # a job not done yet, the job store, or a worker's memory: retry this much later


def no_cluster() -> BlockgradError:
    return BlockgradError(
        "cluster_unavailable",
        "Jobs are off on this server (BLOCKGRAD_DASK_SCHEDULER=off): unset it for the embedded cluster, or "
        "name a scheduler.", {"scheduler": None}, retry_after_s=CLUSTER_RETRY_AFTER_S)


def job_not_found(job_id: str) -> BlockgradError:
    return BlockgradError(
        "job_not_found",
        f"There is no job {job_id}: unknown, deleted, or expired (BLOCKGRAD_JOB_TTL_S after it finished).",
        {"id": job_id})


def job_not_done(job_id: str, status: str) -> BlockgradError:
    waiting = status in ("queued", "running")
    advice = ("retry after the Retry-After seconds" if waiting else "it was cancelled and has no result"
              if status == "cancelled" else "it has no result; GET the job for its error")
    return BlockgradError("job_not_done", f"Job {job_id} is {status}; {advice}.", {"status": status},
                          retry_after_s=RETRY_AFTER_S if waiting else None)


def job_failed(message: str, **details: Any) -> BlockgradError:
    """A job's `error` when the service or the cluster, not the request, is at fault."""
    return BlockgradError("internal_error", message, details)


def job_done(job_id: str, status: str) -> BlockgradError:
    return BlockgradError("job_done", f"Job {job_id} has {status}: there is nothing to cancel (DELETE forgets it).",
                          {"status": status})


def job_attempts_exhausted(attempts: int) -> BlockgradError:
    return BlockgradError(
        "job_attempts_exhausted",
        f"The cluster lost this job's work {attempts} times (BLOCKGRAD_JOB_ATTEMPTS = {attempts}): workers or "
        "the scheduler kept dying under it. Submit it again.", {"limit": "BLOCKGRAD_JOB_ATTEMPTS", "allowed": attempts})


def idempotency_key_reused() -> BlockgradError:
    return BlockgradError(
        "idempotency_key_reused",
        "This Idempotency-Key was sent before with a different request (vectors or fields); use a new key for "
        "a new job, or send the first request again to get its job.", {"header": "Idempotency-Key"})


def store_unavailable() -> BlockgradError:
    return BlockgradError(
        "store_unavailable",
        "The job store (its database) did not answer in time; job routes are unavailable until it does "
        "(synchronous routes are unaffected). Retry after the Retry-After seconds.", {},
        retry_after_s=RETRY_AFTER_S)


def too_many_jobs(active: int, allowed: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"{active} jobs are queued or running, BLOCKGRAD_MAX_JOBS = {allowed}; retry after the Retry-After "
        "seconds.", {"limit": "BLOCKGRAD_MAX_JOBS", "value": active, "allowed": allowed},
        retry_after_s=RETRY_AFTER_S)


def result_too_large(nbytes: int, allowed: int, limit: str) -> BlockgradError:
    """A job whose result could never be kept: `limit` is BLOCKGRAD_MAX_JOB_RESULT_BYTES or,
    when smaller, BLOCKGRAD_MAX_JOB_RESULTS_BYTES."""
    return limit_exceeded(
        f"This job's result would take {nbytes} bytes, over {limit} = {allowed}; ask for fewer outputs "
        "(losses are F x F), a smaller factor or fewer vectors.", limit, nbytes, allowed)


def results_full(held: int, nbytes: int, allowed: int) -> BlockgradError:
    """The results kept and reserved leave no room for this job's until some expire or are deleted."""
    return BlockgradError(
        "overloaded",
        f"The job store holds {held} bytes of results (kept, or reserved by queued and running jobs); this job's "
        f"{nbytes} would pass BLOCKGRAD_MAX_JOB_RESULTS_BYTES = {allowed}. Nothing is evicted before its "
        "BLOCKGRAD_JOB_TTL_S: retry after the Retry-After seconds, or DELETE jobs whose results you have.",
        {"limit": "BLOCKGRAD_MAX_JOB_RESULTS_BYTES", "value": held + nbytes, "allowed": allowed},
        retry_after_s=RETRY_AFTER_S)


def records_full(kept: int, allowed: int) -> BlockgradError:
    """Every finished job kept is still within its TTL."""
    return BlockgradError(
        "overloaded",
        f"The job store keeps {kept} finished jobs, BLOCKGRAD_MAX_JOB_RECORDS = {allowed}, none of them expired "
        "yet; retry after the Retry-After seconds, or DELETE finished jobs.",
        {"limit": "BLOCKGRAD_MAX_JOB_RECORDS", "value": kept, "allowed": allowed}, retry_after_s=RETRY_AFTER_S)


def too_many_vectors(n: int, allowed: int, limit: str = "BLOCKGRAD_MAX_N") -> BlockgradError:
    """`limit`: BLOCKGRAD_MAX_N, or a job's BLOCKGRAD_MAX_JOB_N."""
    return limit_exceeded(f"{n} vectors is over {limit} = {allowed}; send at most {allowed}.", limit, n, allowed)


def too_long_vectors(dim: int, allowed: int) -> BlockgradError:
    return limit_exceeded(f"Vectors of length {dim} are over BLOCKGRAD_MAX_D = {allowed}; send at most {allowed}.",
                          "BLOCKGRAD_MAX_D", dim, allowed)


# Memory (the worker's ledger, app/core/admission.py).
def memory_limit_exceeded(predicted: int, budget: int) -> BlockgradError:
    return limit_exceeded(
        f"This request would take about {predicted // 2 ** 20} MiB at its peak, over "
        f"BLOCKGRAD_WORKER_MEMORY_BYTES = {budget // 2 ** 20} MiB per worker; send a larger factor, "
        "fewer outputs (binary /v2 outputs are the smallest), float32 or fewer vectors.",
        "BLOCKGRAD_WORKER_MEMORY_BYTES", predicted, budget)


def memory_busy(predicted: int, reserved: int, budget: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"This worker's memory is taken by the requests it holds ({reserved // 2 ** 20} MiB of "
        f"{budget // 2 ** 20} MiB); this one needs about {predicted // 2 ** 20} MiB: retry after the "
        "Retry-After seconds, on any replica.",
        {"limit": "BLOCKGRAD_WORKER_MEMORY_BYTES", "value": predicted, "reserved": reserved, "allowed": budget},
        retry_after_s=RETRY_AFTER_S)


def uploads_busy(nbytes: int, uploading: int, allowed: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"This worker's bodies still arriving hold {uploading // 2 ** 20} MiB of the {allowed // 2 ** 20} MiB "
        "they may share (BLOCKGRAD_UPLOAD_MEMORY_SHARE of BLOCKGRAD_WORKER_MEMORY_BYTES); send the body faster, "
        "or retry after the Retry-After seconds, on any replica.",
        {"limit": "BLOCKGRAD_UPLOAD_MEMORY_SHARE", "value": nbytes, "reserved": uploading, "allowed": allowed},
        retry_after_s=RETRY_AFTER_S)


def upload_limit_exceeded(nbytes: int, allowed: int) -> BlockgradError:
    return limit_exceeded(
        f"This body takes about {nbytes // 2 ** 20} MiB while it arrives, over the {allowed // 2 ** 20} MiB "
        "that bodies still arriving may hold (BLOCKGRAD_UPLOAD_MEMORY_SHARE of BLOCKGRAD_WORKER_MEMORY_BYTES); "
        "send a smaller body.", "BLOCKGRAD_UPLOAD_MEMORY_SHARE", nbytes, allowed)
