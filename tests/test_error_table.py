"""The one error table: every code has the status the docs' table gives (literals here), and
where /openapi.json documents an example, it is the answer the app sends.

Each code's real condition, on the server users run, is tests/test_contract.py's. Here, in
process: the codes whose condition a test client can make as it is, and the two injected
faults that no request can cause (`internal_error`: a bug; `device_out_of_memory`: a GPU out
of memory), made by patching the call that fails.
"""
import time

import numpy as np
import pytest
import torch

from app import create_app
from app.api.v2.views import ERROR_STYLE as V2_STYLE
from app.core.errors import job_attempts_exhausted
from app.extensions import services_of
from app.http.errors import ERROR_CODE_HEADER, ERRORS, error_body
from app.jobs import db

from .test_contract import PRODUCED

V1 = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]}


def post_v1(**changes):
    return lambda client: client.post("/v1/gradients", json={**V1, **changes})


def fail_with(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


def finished_job(client) -> str:
    """A job accepted, then claimed and finished in the store as the runner does."""
    job_id = client.post("/v1/jobs", json={**V1, "factor": 1}).get_json()["id"]
    engine = services_of(client.application).jobs.engine
    attempt = db.claim(engine, job_id, "runner", time.time(), 30.0, 3)
    arrays = {"accumulated": np.ones((3, 2), np.float32), "losses": np.ones((1, 1), np.float32)}
    assert db.finish_job(engine, job_id, "runner", attempt, time.time(), arrays, None)
    return job_id


def reused_key(client):
    headers = {"Idempotency-Key": "once"}
    assert client.post("/v1/jobs", json=V1, headers=headers).status_code == 202
    return client.post("/v1/jobs", json={**V1, "factor": 3}, headers=headers)


# code -> (settings, the request that triggers it, patches (target, value), error style)
TRIGGERS = {
    "bad_json": ({}, lambda c: c.post("/v1/gradients", data="x", content_type="application/json"), [], None),
    "unauthorized": ({"BLOCKGRAD_API_TOKEN": "s3cret"}, post_v1(), [], None),
    "not_found": ({}, lambda c: c.get("/v1/gradient"), [], None),
    "model_not_found": ({}, lambda c: c.get("/v2/models/other"), [], V2_STYLE),
    "method_not_allowed": ({}, lambda c: c.post("/healthz"), [], None),
    "too_large": ({}, lambda c: c.post("/v1/gradients", data=b" " * (32 * 1024 * 1024 + 1),
                                       content_type="application/json"), [], None),
    "limit_exceeded": ({}, lambda c: c.post("/v1/gradients", json={"vectors": [[1.0]] * 8193}), [], None),
    "unsupported_media_type": ({}, lambda c: c.post("/v1/gradients", data="x", content_type="text/plain"), [], None),
    "validation_error": ({}, post_v1(factor=4), [], None),
    "non_finite_result": ({}, lambda c: c.post("/v1/gradients", json={
        "vectors": [[0.0], [1e20]], "factor": 2, "objective": "sum_of_squares"}), [], None),
    "internal_error": ({}, post_v1(), [("app.http.pipeline.run", fail_with(RuntimeError("boom")))], None),
    "device_out_of_memory": ({}, post_v1(), [("app.core.run.load_vectors",
                                              fail_with(torch.OutOfMemoryError("out of memory")))], None),
    "not_ready": ({"BLOCKGRAD_DEVICE": "cuda"}, lambda c: c.get("/readyz"), [], None),
    "job_not_found": ({}, lambda c: c.get("/v1/jobs/nope"), [], None),
    "cluster_unavailable": ({"BLOCKGRAD_DASK_SCHEDULER": "off"}, lambda c: c.get(f"/v1/jobs/{'0' * 32}"), [], None),
    "store_unavailable": ({"BLOCKGRAD_JOBS_DB": "postgresql://blockgrad:x@127.0.0.1:1/blockgrad"},  # refused
                          lambda c: c.get(f"/v1/jobs/{'0' * 32}"), [], None),
    "job_done": ({}, lambda c: c.post(f"/v1/jobs/{finished_job(c)}/cancel"),
                 [("app.jobs.store.secrets.token_hex", lambda nbytes: "0" * 32)], None),  # the example's id
    "idempotency_key_reused": ({}, reused_key, [], None),
}
# A failed job's `error.code`, never an answer's: test_a_job_out_of_attempts_shows_the_tables_error below.
RECORD_ONLY = {"job_attempts_exhausted"}


# The contract, written out from the README's error table (not from the code under test):
# code -> (status, details for the trigger above, words the message must hold, headers).
CONTRACT = {
    "bad_json": (400, {}, ["JSON"], {}),
    "unauthorized": (401, {}, ["Authorization: Bearer"], {"WWW-Authenticate": "Bearer"}),
    "not_found": (404, None, ["/v1/gradient", "POST /v1/gradients"], {}),
    "model_not_found": (404, None, ["other", "blockgrad"], {}),
    "job_not_found": (404, {"id": "nope"}, ["nope"], {}),
    "cluster_unavailable": (503, {"scheduler": None}, ["BLOCKGRAD_DASK_SCHEDULER"], {"Retry-After": ""}),
    "store_unavailable": (503, {}, ["job store", "synchronous routes are unaffected"], {"Retry-After": ""}),
    "job_done": (409, {"status": "succeeded"}, ["succeeded", "nothing to cancel"], {}),
    "idempotency_key_reused": (422, {"header": "Idempotency-Key"}, ["Idempotency-Key", "different request"], {}),
    "method_not_allowed": (405, {"allowed": ["GET", "HEAD", "OPTIONS"]}, ["POST", "GET"], {"Allow": "GET"}),
    "too_large": (413, {"limit": "BLOCKGRAD_MAX_BODY_BYTES", "allowed": 32 * 1024 * 1024}, ["33554432"], {}),
    "limit_exceeded": (413, {"limit": "BLOCKGRAD_MAX_N", "value": 8193, "allowed": 8192},
                       ["BLOCKGRAD_MAX_N", "8192"], {}),
    "unsupported_media_type": (415, {}, ["application/json"], {}),
    "validation_error": (422, {"fields": {"factor": ["Must be between 1 and N = 3."]}}, ["factor"], {}),
    "non_finite_result": (422, {"block": {"row": 0, "col": 1}}, ["float64"], {}),
    "internal_error": (500, {}, [], {}),
    "device_out_of_memory": (503, {}, ["memory"], {"Retry-After": ""}),
    "not_ready": (503, {}, ["BLOCKGRAD_DEVICE=cuda"], {}),
}


# docs/api.md's error table: each code's status ((499): never sent, logged with it).
STATUSES = {
    "bad_request": 400, "bad_json": 400, "unauthorized": 401, "not_found": 404, "model_not_found": 404,
    "job_not_found": 404, "method_not_allowed": 405, "read_timeout": 408, "job_not_done": 409, "job_done": 409,
    "too_large": 413, "limit_exceeded": 413, "unsupported_media_type": 415, "validation_error": 422,
    "non_finite_result": 422, "idempotency_key_reused": 422,
    "internal_error": 500, "deadline_exceeded": 503, "device_out_of_memory": 503,
    "cluster_unavailable": 503, "store_unavailable": 503, "job_attempts_exhausted": 503, "not_ready": 503,
    "overloaded": 503, "client_closed": 499,
}


def test_every_code_has_its_documented_status():
    assert {code: entry.status for code, entry in ERRORS.items()} == STATUSES


def test_every_code_is_produced_somewhere():
    """In process here, or on a real server by tests/test_contract.py (the two injected faults only here)."""
    assert set(TRIGGERS) == set(CONTRACT)
    assert set(TRIGGERS) | set(PRODUCED) | RECORD_ONLY == set(ERRORS)
    assert {"internal_error", "device_out_of_memory"} <= set(TRIGGERS) - set(PRODUCED)


def documented_examples(client) -> dict:
    """code -> the example body /openapi.json documents for it (any route, any status)."""
    spec = client.get("/openapi.json").get_json()
    examples = {}
    for operations in spec["paths"].values():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            for status, response in operation.get("responses", {}).items():
                for content in response.get("content", {}).values():
                    for code, example in (content.get("examples") or {}).items():
                        examples.setdefault((code, status), example["value"])
    return examples


@pytest.mark.parametrize("code", sorted(TRIGGERS))
def test_the_service_sends_what_the_contract_says(code, monkeypatch, tmp_path):
    if code == "not_ready" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    settings, send, patches, style = TRIGGERS[code]
    client = create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path), **settings}).test_client()
    examples = documented_examples(client)
    for target, value in patches:
        monkeypatch.setattr(target, value)
    response = send(client)
    status, details, words, headers = CONTRACT[code]
    assert response.status_code == status
    assert response.headers[ERROR_CODE_HEADER] == code
    body = response.get_json()
    if style:  # /v2: the protocol's {"error": "<message>"}
        assert set(body) == {"error"} and isinstance(body["error"], str)
        message = body["error"]
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
        assert body["error"]["code"] == code
        message = body["error"]["message"]
        if details is not None:
            assert body["error"]["details"] == details
    assert message and all(word in message for word in words), message
    for name, value in headers.items():
        assert value in response.headers[name]
    if "Retry-After" in headers:
        assert int(response.headers["Retry-After"]) >= 1
    # Where /openapi.json documents this code at this status, its example is this very answer.
    documented = examples.get((code, str(status)))
    if documented is not None and code != "not_found":
        assert body == documented


def test_not_found_lists_every_route_of_this_app(client):
    body = client.get("/v1/gradient").get_json()["error"]
    assert body["code"] == "not_found"
    routes = body["details"]["routes"]
    assert {"POST /v1/gradients", "GET /v1/objectives", "GET /healthz", "GET /readyz", "GET /metrics",
            "POST /v2/models/<model>/infer", "GET /v2"} <= set(routes)
    assert all(route in body["message"] for route in routes)


def test_most_codes_are_documented_with_an_example(client):
    documented = {code for code, _ in documented_examples(client)}
    assert set(CONTRACT) - documented <= {"bad_request", "not_found", "method_not_allowed", "client_closed"}


def test_v2_documents_the_same_codes_in_its_own_shape():
    spec = create_app({"TESTING": True}).test_client().get("/openapi.json").get_json()
    infer = spec["paths"]["/v2/models/{model}/infer"]["post"]["responses"]
    examples = infer["400"]["content"]["application/json"]["examples"]
    assert examples["validation_error"]["value"] == {"error": "The request is not valid; fix these fields: factor."}
    assert set(examples) >= {"bad_json", "validation_error", "non_finite_result"}  # 422s answered as 400


def test_a_job_out_of_attempts_shows_the_tables_error(tmp_path):
    """Its work lost BLOCKGRAD_JOB_ATTEMPTS times (each attempt claimed again by its runner):
    the job fails with the error the table's example is."""
    client = create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    job_id = client.post("/v1/jobs", json=V1).get_json()["id"]
    engine = services_of(client.application).jobs.engine
    held = None
    for attempt in (1, 2, 3):
        held = db.claim(engine, job_id, "runner", time.time(), 30.0, 3, held)
        assert held == attempt
    assert db.claim(engine, job_id, "runner", time.time(), 30.0, 3, held) is None
    record = client.get(f"/v1/jobs/{job_id}").get_json()
    assert (record["status"], record["attempts"]) == ("failed", 3)
    assert record["error"]["code"] == "job_attempts_exhausted" and "3 times" in record["error"]["message"]
    assert {"error": record["error"]} == error_body(job_attempts_exhausted(3)) == error_body(
        ERRORS["job_attempts_exhausted"].example())
