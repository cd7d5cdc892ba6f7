"""/v1/jobs: a computation too large for one request, kept in the job store and run on the
Dask cluster by the job runner (docs/jobs.md).

POST takes /v1/gradients' JSON body, or the vectors as a .npy file (application/x-npy)
with the other fields as query parameters; GET reads the job record or its result (streamed
from the store: JSON, or a .npz written as a zip stream); POST .../cancel cancels a queued or
running job; DELETE forgets a job.
"""
import io
import math
import zipfile
from collections.abc import Iterator

import numpy as np
import orjson
from flask import Request, Response, request
from flask_smorest import Blueprint
from marshmallow import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from ...core.admission import check_activations
from ...core.dtypes import DTYPES
from ...core.engine import block_bounds
from ...core.errors import field_error, validation_error
from ...core.request import Sizes
from ...extensions import Services, services
from ...http.body import is_json_mimetype, read_body, reserve_for_request
from ...http.docs import documented, documents_errors
from ...http.errors import bad_request, too_large, unsupported_media_type
from ...http.pipeline import Described, http_call, pipeline
from ...http.sending import NUMPY
from ...jobs.db import RESULT_CHUNK_BYTES, SQLITE_CACHE_BYTES
from ...jobs.limits import admit_job
from ...jobs.store import JobStore
from .gradients import decode
from .job_schemas import JOB_OUTPUTS, JobRequestSchema, JobResultSchema, JobSchema, job_output

blp = Blueprint("jobs", __name__, url_prefix="/v1",
                   description="Jobs: gradients of any size up to BLOCKGRAD_MAX_JOB_N, computed on the Dask cluster.")

NPY = "application/x-npy"
NPZ = "application/x-npz"
QUERY_FIELDS = ("factor", "objective", "offset", "outputs", "dtype")
JOB_SCHEMA = JobRequestSchema()
DTYPE_OF_ITEM_BYTES = {dtype.item_bytes: name for name, dtype in DTYPES.items()}  # a .npy's float width
# A result streamed holds one chunk read from the store at a time, sent in pieces of about
# PIECE_BYTES of numbers: each piece's text (JSON) or copy in the zip stream (.npz), and the
# bytes handed on; run-to-run noise on top.
PIECE_BYTES = 256 * 1024
STREAM_MARGIN = 2  # allocator and socket buffers on top: bench J5 measures the whole
REQUEST_BODY = {"required": True, "content": {
    "application/json": {"schema": JobRequestSchema},
    NPY: {"schema": {"type": "string", "format": "binary",
                     "description": "A .npy file of shape (N, D), float32 or float64 (the job's dtype; never a "
                                    "pickle); factor, objective, offset, outputs (comma-separated) and dtype as "
                                    "query parameters. At most BLOCKGRAD_MAX_JOB_BODY_BYTES."}}}}


def json_response(body, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body, option=NUMPY), status=status, headers=headers, mimetype="application/json")


def load_npy(data: bytes) -> np.ndarray:
    """An (N, D) float32 or float64 array, never unpickled; 400 if it is not a .npy file, or if
    its header declares more or fewer bytes than follow it (checked before anything is allocated)."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        # Version 3.0 differs from 2.0 only in its header's encoding (utf-8, for field names).
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(stream)
        if not dtype.hasobject:  # a pickle's size is not its header's: refused below
            declared, sent = math.prod(shape) * dtype.itemsize, len(data) - stream.tell()
            if declared != sent:
                raise bad_request(f"The .npy header declares shape {shape} of {dtype}: {declared} bytes of data, "
                                  f"but {sent} follow it; send numpy.save's output.",
                                  {"declared_bytes": declared, "body_bytes": sent})
        array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise field_error("vectors", "The .npy holds Python objects (a pickle), which are never loaded; "
                                         "send an (N, D) float32 or float64 array.") from None
        raise bad_request(f"The body is not a readable .npy file ({exc}); send numpy.save's output.") from None
    except (EOFError, OSError) as exc:
        raise bad_request(f"The body is not a complete .npy file ({exc}); send numpy.save's output.") from None
    if array.dtype.kind != "f" or array.dtype.itemsize not in DTYPE_OF_ITEM_BYTES:
        raise field_error("vectors", f"The .npy holds {array.dtype}; send float32 or float64.")
    if array.ndim != 2:
        raise field_error("vectors", f"The .npy has shape {array.shape}; send (N, D).")
    return np.ascontiguousarray(array, dtype=f"=f{array.dtype.itemsize}")  # native byte order


def query_fields(args, vectors: np.ndarray) -> tuple[dict, dict]:
    """A .npy job's other fields from the query string, with the JSON body's rules: (the valid
    ones, the errors)."""
    unknown = sorted(set(args) - set(QUERY_FIELDS))
    if unknown:
        raise validation_error({name: ["Unknown query parameter."] for name in unknown},
                               f"Unknown query parameters {', '.join(unknown)}; they are {', '.join(QUERY_FIELDS)}.")
    file_dtype = DTYPE_OF_ITEM_BYTES[vectors.dtype.itemsize]
    errors, values = {}, {"dtype": file_dtype}
    if args.get("dtype", file_dtype) != file_dtype:
        errors["dtype"] = [f"The .npy holds {file_dtype}: a .npy job's dtype is its file's; leave dtype out."]
    for name, parse in (("factor", int), ("offset", float)):
        if name in args:
            try:
                values[name] = parse(args[name])
            except ValueError:
                errors[name] = [f"Not a valid {'integer' if parse is int else 'number'}."]
    if "offset" in values and not np.isfinite(values["offset"]):
        errors["offset"] = ["Must be a finite number."]
        del values["offset"]
    if "objective" in args:
        values["objective"] = args["objective"]
    outputs = [name for name in args.get("outputs", ",".join(JOB_OUTPUTS)).split(",") if name]
    for name in outputs:
        try:
            job_output(name)
        except ValidationError as exc:
            errors.setdefault("outputs", []).extend(exc.messages)
    if not outputs:
        errors["outputs"] = ["Name at least one of: accumulated, losses."]
    if "outputs" not in errors:
        values["outputs"] = outputs
    return values, errors


def decode_job(request: Request) -> Described:
    """/v1/gradients' JSON body (job_schemas.py's fields), or a .npy and the query string."""
    mimetype = request.mimetype
    if not mimetype or is_json_mimetype(mimetype):  # no Content-Type: JSON, as on /v1/gradients
        return decode(request, JOB_SCHEMA)
    if mimetype != NPY:
        raise unsupported_media_type(f"Send the body as Content-Type: application/json or {NPY} "
                                     f"(got {mimetype or 'none'!r}).")
    limit = request.max_content_length = services().jobs.settings.max_job_body_bytes
    try:
        data = read_body(request)
    except RequestEntityTooLarge:
        raise too_large(limit, "BLOCKGRAD_MAX_JOB_BODY_BYTES", ".npy body") from None
    vectors = load_npy(data)
    fields, errors = query_fields(request.args, vectors)
    return Described(*vectors.shape, vectors, fields, errors)


def admit_job_sizes(sizes: Sizes, described: Described, served: Services) -> None:
    """A job's own limits (app/jobs/limits.py), and a model's activations for its largest block."""
    admit_job(sizes, served.settings.max_d, served.jobs.settings)
    if sizes.factor is not None:
        check_activations(sizes, served.settings)


@blp.route("/jobs", methods=["POST"])
@blp.doc(requestBody=REQUEST_BODY, parameters=[
    {"in": "header", "name": "Idempotency-Key", "required": False, "schema": {"type": "string"},
     "description": "A retried POST with the same key gets the same job instead of a second one."},
    *({"in": "query", "name": name, "required": False, "schema": {"type": "string"},
       "description": f"With a .npy body: the JSON body's `{name}`" + (", comma-separated" * (name == "outputs"))}
      for name in QUERY_FIELDS)])
@blp.response(202, JobSchema, headers={"Location": {"description": "/v1/jobs/{id}", "schema": {"type": "string"}}})
@documents_errors(blp, "bad_request", "bad_json", "unauthorized", "too_large", "limit_exceeded",
                  "unsupported_media_type", "validation_error", "idempotency_key_reused", "read_timeout",
                  "overloaded", "store_unavailable", "cluster_unavailable", "internal_error")
def post_job():
    """Submit a job: stored, then answered at once (202) with its record, whatever the cluster does."""
    key = request.headers.get("Idempotency-Key") or None  # a retried POST with it gets the same job
    # The pipeline's execute step for a job: the job store's submit.
    record, _ = pipeline(decode_job(request), http_call(), lambda req, described, served: served.jobs.submit(req, key),
                         admit_job_sizes)
    return json_response(record, 202, {"Location": f"/v1/jobs/{record['id']}"})


JOB_ERRORS = ("unauthorized", "job_not_found", "store_unavailable", "cluster_unavailable", "internal_error")


@blp.route("/jobs/<job_id>", methods=["GET"])
@blp.response(200, JobSchema)
@documents_errors(blp, *JOB_ERRORS)
def get_job(job_id: str):
    """The job record: status, progress, attempts, times, error."""
    return json_response(services().jobs.view(job_id))


@blp.route("/jobs/<job_id>/cancel", methods=["POST"])
@blp.response(200, JobSchema, description="The job is cancelled (it was queued, running or cancelled already).")
@documents_errors(blp, "job_done", *JOB_ERRORS)
def cancel_job(job_id: str):
    """Cancel a queued or running job; a succeeded or failed one is 409 job_done."""
    return json_response(services().jobs.cancel(job_id))


@blp.route("/jobs/<job_id>", methods=["DELETE"])
@documented(blp.response(204, description="Forgotten, with its input and result (cancelled first if it ran); "
                                          "every route of it is then 404."))
@documents_errors(blp, *JOB_ERRORS)
def delete_job(job_id: str):
    """Forget a job, whatever its status."""
    services().jobs.delete(job_id)
    return Response(status=204)


@blp.route("/jobs/<job_id>/result", methods=["GET"])
@documented(blp.response(200, JobResultSchema, description=f"JSON; or, when Accept is exactly {NPZ}, a .npz file "
                                                           "of the outputs asked for and bounds. Streamed."))
@documents_errors(blp, "job_not_done", "limit_exceeded", "overloaded", *JOB_ERRORS)
def get_result(job_id: str):
    """A succeeded job's result: the shapes and number formatting of /v1/gradients."""
    binary = request.headers.get("Accept", "").strip() == NPZ
    jobs = services().jobs
    row = jobs.result(job_id)
    reserve_for_request(services().ledger, stream_bytes(row["dtype"], binary))
    body = npz_stream(jobs, row) if binary else json_stream(jobs, row)
    return Response(body, mimetype=NPZ if binary else "application/json")


def shapes(row: dict) -> dict[str, tuple[int, int]]:
    """Each output the job kept, with its shape."""
    every = {"accumulated": (row["n"], row["dim"]), "losses": (row["factor"], row["factor"])}
    return {name: every[name] for name in row["outputs"]}


def json_stream(jobs: JobStore, row: dict) -> Iterator[bytes]:
    """The bytes orjson writes for the whole answer (/v1's head, then each output), a piece of
    rows at a time: a 2-d array's text is its rows' texts joined by commas."""
    head = {"n": row["n"], "dim": row["dim"], "factor": row["factor"], "bounds": block_bounds(row["n"], row["factor"]),
            "objective": row["objective"], "dtype": row["dtype"], "device": "cpu"}
    yield orjson.dumps(head)[:-1]
    for name, (rows, _) in shapes(row).items():
        yield b"," + orjson.dumps(name) + b":["
        for k, part in enumerate(pieces(jobs, row, name, rows)):
            yield b"," * (k > 0) + orjson.dumps(part, option=NUMPY)[1:-1]
        yield b"]"
    yield b"}"


def pieces(jobs: JobStore, row: dict, output: str, rows: int) -> Iterator[np.ndarray]:
    """The output's rows as stored, in views of about PIECE_BYTES: each rendered and sent alone."""
    for chunk in jobs.chunks(row, output, rows):
        step = max(1, PIECE_BYTES // max(1, chunk[:1].nbytes))
        yield from (chunk[start:start + step] for start in range(0, len(chunk), step))


class Sink:
    """A write-only file: zipfile writes the archive into it, the stream takes what was written."""

    def __init__(self):
        self.pieces: list[bytes] = []

    def write(self, data) -> int:
        self.pieces.append(bytes(data))
        return len(self.pieces[-1])  # bytes: `data` may be a 2-d memoryview

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        data = b"".join(self.pieces)
        self.pieces.clear()
        return data


def npz_stream(jobs: JobStore, row: dict) -> Iterator[bytes]:
    """What np.savez writes (bounds, then the outputs), as a zip stream: each array's .npy header,
    then its rows a chunk at a time (stored, sizes in data descriptors)."""
    sink = Sink()
    dtype = np.dtype(row["dtype"])
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED) as archive:
        with archive.open("bounds.npy", "w") as file:
            np.lib.format.write_array(file, np.asarray(block_bounds(row["n"], row["factor"]), dtype=np.int64))
        for name, shape in shapes(row).items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as file:
                np.lib.format.write_array_header_1_0(file, {"descr": dtype.str, "fortran_order": False, "shape": shape})
                for part in pieces(jobs, row, name, shape[0]):
                    file.write(np.ascontiguousarray(part, dtype=dtype).data)
                    yield sink.take()
    yield sink.take()


def stream_bytes(dtype: str, binary: bool) -> int:
    """What streaming a job's result holds at its peak, whatever its size: a chunk and a piece's
    rendering, and the store connection it reads through (its page cache, db.SQLITE_CACHE_BYTES)."""
    item = DTYPES[dtype]
    piece = PIECE_BYTES if binary else PIECE_BYTES // item.item_bytes * item.text_bytes
    return int((RESULT_CHUNK_BYTES + 2 * piece + SQLITE_CACHE_BYTES) * STREAM_MARGIN)
