"""Client: one HTTP session (connection reuse), the bearer token, a timeout per call,
and retries only where they are safe.

Safe to retry (nothing ran, nothing was answered):
- the connection failed before any byte of an answer came back;
- 503 `overloaded` (the server refused the request before starting it);
- 503 `cluster_unavailable` (a job route could not reach the Dask scheduler: nothing was submitted,
  and a job submission carries an Idempotency-Key);
- 503 `deadline_exceeded` only when `details.queued` is true (it waited in the queue
  and never started).
Each waits the answer's Retry-After (else a short backoff), at most `retries` times
and never past the call's total `deadline_s`. Never retried: a timeout while
waiting for an answer, an answer cut short, any other error.
"""
import json
import time
from contextlib import contextmanager

import ijson
import numpy as np
import requests
import urllib3

from . import infer as codec
from .errors import ERROR_BODY_BYTES, BlockgradError, error_from_answer
from .gradients import GradientResult, collect, iter_gradient_answer
from .jobs import Job, submit_job

RETRYABLE_CODES = {"overloaded", "cluster_unavailable"}
BACKOFF_S = (0.2, 0.5, 1.0, 2.0)  # waits when the answer gives no Retry-After
GRADIENTS_PATH = "/v1/gradients"
INFER_PATH = f"/v2/models/{codec.MODEL_NAME}/infer"
# Reading a body that stops partway: urllib3's errors (requests does not wrap raw reads) and ijson's.
BROKEN_BODY = (urllib3.exceptions.HTTPError, requests.RequestException, ijson.JSONError, OSError)


def is_retryable(error: BlockgradError) -> bool:
    if error.status is None:
        return error.code == "connection_failed"
    if error.status != 503:
        return False
    return error.code in RETRYABLE_CODES or (
        error.code == "deadline_exceeded" and error.details.get("queued") is True)


class Client:
    """url: the service's base URL (http://host:port). token: BLOCKGRAD_API_TOKEN, sent as a
    bearer token. timeout: seconds to wait for the server (connecting, and between bytes of
    the answer) on each attempt. retries: extra attempts where safe (see above).
    deadline_s: most seconds one call may take, its retries and their waits included.
    The default timeout outlasts the server's default deadline (BLOCKGRAD_REQUEST_TIMEOUT_S,
    60 s), so its 503 deadline_exceeded arrives instead of a client-side timeout. One client
    per thread: it keeps one requests.Session."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 120.0, *, retries: int = 3,
                 deadline_s: float = 600.0, session: requests.Session | None = None):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.deadline_s = deadline_s
        self.session = session or requests.Session()
        self.session.headers["User-Agent"] = "blockgrad-client/0.1"
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the service's calls -----------------------------------------------------------------
    def gradients(self, vectors, *, timeout: float | None = None, **fields) -> GradientResult:
        """POST /v1/gradients: `vectors` (N, D) and the request's fields (factor, objective,
        offset, outputs, dtype). The answer is read block by block as it streams in."""
        with self.stream_gradients(vectors, timeout=timeout, **fields) as (head, blocks):
            return collect(head, blocks)

    @contextmanager
    def stream_gradients(self, vectors, *, timeout: float | None = None, **fields):
        """Like gradients(), for answers too large to keep: yields (head, blocks), the head's
        values as arrays and an iterator that reads each block off the wire when advanced.

            with client.stream_gradients(v, outputs=["blocks"]) as (head, blocks):
                for block in blocks: ...
        """
        body = json.dumps({"vectors": np.asarray(vectors).tolist(), **fields}, allow_nan=False).encode()
        response = self.request("POST", GRADIENTS_PATH, data=body, timeout=timeout,
                                headers={"Content-Type": "application/json"})
        with response:
            try:
                head, blocks = iter_gradient_answer(response.raw)
            except BROKEN_BODY as exc:
                raise incomplete(exc) from exc
            yield head, checked(blocks)

    def infer(self, vectors, *, outputs=None, datatype: str | None = None, timeout: float | None = None,
              **parameters) -> dict[str, np.ndarray]:
        """POST /v2/models/blockgrad/infer with `vectors` as binary tensor data (FP64 for float64
        arrays, else FP32, or `datatype`) and the model's parameters (factor, objective, offset);
        returns the outputs (all four unless `outputs` names some) as numpy arrays, by name."""
        body, headers = codec.binary_infer_request(vectors, parameters, outputs, datatype=datatype)
        response = self.request("POST", INFER_PATH, data=body, headers=headers, timeout=timeout)
        with response:
            try:
                content = response.content
            except BROKEN_BODY as exc:
                raise incomplete(exc) from exc
        try:
            _, tensors = codec.read_infer_response(content, response.headers)
        except (ValueError, KeyError, TypeError) as exc:
            raise BlockgradError("bad_response", f"The /v2 answer could not be read: {exc}", status=200) from exc
        return tensors

    def submit_job(self, vectors, **fields) -> Job:
        """POST /v1/jobs: `vectors` (N, D) sent as a .npy body, and the job's fields (factor,
        objective, offset, outputs, dtype; idempotency_key, default a fresh one). The Job has
        status(), wait(timeout=None, progress=False), result() (numpy arrays) and cancel()."""
        return submit_job(self, vectors, **fields)

    def objectives(self, *, timeout: float | None = None) -> list[dict]:
        """GET /v1/objectives: the built-ins and the operator's models (name, kind, dim, dtypes, description)."""
        return self.get_json("/v1/objectives", timeout=timeout)["objectives"]

    def model_metadata(self, *, timeout: float | None = None) -> dict:
        return self.get_json(f"/v2/models/{codec.MODEL_NAME}", timeout=timeout)

    def get_json(self, path: str, *, timeout: float | None = None):
        with self.request("GET", path, timeout=timeout) as response:
            try:
                return json.loads(response.content)
            except ValueError as exc:
                raise BlockgradError("bad_response", f"{path} did not answer JSON: {exc}",
                                     status=response.status_code) from exc

    # -- one call, with its safe retries --------------------------------------------------------
    def request(self, method: str, path: str, *, timeout: float | None = None, **kwargs) -> requests.Response:
        """A successful answer whose body is still to be read (stream=True); raises
        BlockgradError for an error answer or no answer, after the safe retries."""
        timeout = self.timeout if timeout is None else timeout
        end = time.monotonic() + self.deadline_s
        attempt = 0
        while True:
            error = self.attempt(method, path, min(timeout, max(0.001, end - time.monotonic())), kwargs)
            if not isinstance(error, BlockgradError):
                return error  # the answer
            wait = error.retry_after_s if error.retry_after_s is not None else BACKOFF_S[min(attempt, 3)]
            if attempt >= self.retries or not is_retryable(error) or time.monotonic() + wait >= end:
                raise error
            time.sleep(wait)
            attempt += 1

    def attempt(self, method: str, path: str, timeout: float, kwargs) -> requests.Response | BlockgradError:
        try:
            response = self.session.request(method, self.url + path, timeout=timeout, stream=True, **kwargs)
        except requests.ConnectionError as exc:  # before any byte of an answer (ConnectTimeout included)
            return BlockgradError("connection_failed", f"No answer from {self.url}: {exc}")
        except requests.Timeout as exc:  # the request was sent: the computation may be running
            return BlockgradError("timeout", f"No answer within {timeout:g} s: {exc}")
        response.raw.decode_content = True  # raw reads undo a Content-Encoding, as response.content does
        if response.status_code < 400:
            return response
        with response:
            try:
                body = response.raw.read(ERROR_BODY_BYTES)
            except BROKEN_BODY:
                body = b""
        return error_from_answer(response.status_code, response.headers, body)


def checked(blocks):
    """The blocks; a body that stops partway becomes BlockgradError incomplete_response."""
    try:
        yield from blocks
    except BROKEN_BODY as exc:
        raise incomplete(exc) from exc


def incomplete(exc: Exception) -> BlockgradError:
    return BlockgradError("incomplete_response",
                          f"The answer stopped partway ({type(exc).__name__}: {exc}); nothing of it can be trusted.",
                          status=200)
