"""The one error table: every code is sent with the status, details and headers the README's
table gives (literals here), and where /openapi.json documents an example, it is the answer."""
import pytest
import torch
from gunicorn.http.errors import InvalidChunkSize
from werkzeug.exceptions import BadRequest, ClientDisconnected

from app import create_app
from app.api.v2.views import ERROR_STYLE as V2_STYLE
from app.core.errors import client_closed, job_not_done
from app.core.gate import Gate
from app.core.deadline import Deadline
from app.http.errors import ERROR_CODE_HEADER, ERRORS

V1 = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]}


def post_v1(**changes):
    return lambda client: client.post("/v1/gradients", json={**V1, **changes})


def fail_with(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


class ExpiredDeadline(Deadline):
    """The default 60 s deadline, already past when first checked."""

    def __init__(self, timeout_s, **kwargs):
        super().__init__(timeout_s, **kwargs)
        self.expires = 0


class ClientGone(Deadline):
    """A client that has left by the first check between blocks."""

    def check(self):
        raise client_closed()


def full_gate():
    """The slot taken and 4 requests waiting: the next is refused."""
    gate = Gate(queue_depth=4, slots=0)
    gate._queue.extend(object() for _ in range(4))
    return gate


class FiredAlarm:
    """The read deadline passed while the body was being read."""
    fired = True

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def running_job_result(store, job_id, before_fetch=None):
    """JobStore.result when every job is still running."""
    raise job_not_done(job_id, "running")


# code -> (settings, the request that triggers it, patches (target, value), error style)
TRIGGERS = {
    "bad_request": ({}, post_v1(), [("app.http.parsing.read_body",
                                                         fail_with(InvalidChunkSize(b"zz")))], None),
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
    "deadline_exceeded": ({}, post_v1(), [("app.core.deadline.Deadline", ExpiredDeadline)], None),
    "device_out_of_memory": ({}, post_v1(), [("app.core.run.load_vectors",
                                              fail_with(torch.OutOfMemoryError("out of memory")))], None),
    "not_ready": ({"BLOCKGRAD_DEVICE": "cuda"}, lambda c: c.get("/readyz"), [], None),
    "read_timeout": ({}, post_v1(), [("app.http.parsing.ReadAlarm", FiredAlarm),
                                     ("app.http.parsing.read_arriving", fail_with(ClientDisconnected()))], None),
    "overloaded": ({}, post_v1(), [("app.http.pipeline.compute_slot", lambda deadline: full_gate().acquire(deadline))], None),
    "client_closed": ({}, post_v1(), [("app.core.deadline.Deadline", ClientGone)], None),
    "job_not_found": ({}, lambda c: c.get("/v1/jobs/nope"), [], None),
    "job_not_done": ({}, lambda c: c.get(f"/v1/jobs/{'0' * 32}/result"),
                     [("app.jobs.store.JobStore.result", running_job_result)], None),
    "cluster_unavailable": ({"BLOCKGRAD_DASK_SCHEDULER": "tcp://127.0.0.1:1"}, lambda c: c.get(f"/v1/jobs/{'0' * 32}"),
                            [], None),
}


# The contract, written out from the README's error table (not from the code under test):
# code -> (status, details for the trigger above, words the message must hold, headers).
CONTRACT = {
    "bad_request": (400, {}, ["HTTP/1.1"], {}),
    "bad_json": (400, {}, ["JSON"], {}),
    "unauthorized": (401, {}, ["Authorization: Bearer"], {"WWW-Authenticate": "Bearer"}),
    "not_found": (404, None, ["/v1/gradient", "POST /v1/gradients"], {}),
    "model_not_found": (404, None, ["other", "blockgrad"], {}),
    "job_not_found": (404, {"id": "nope"}, ["nope"], {}),
    "job_not_done": (409, {"status": "running"}, ["running"], {"Retry-After": ""}),
    "cluster_unavailable": (503, {"scheduler": "tcp://127.0.0.1:1"}, ["scheduler"], {"Retry-After": ""}),
    "method_not_allowed": (405, {"allowed": ["GET", "HEAD", "OPTIONS"]}, ["POST", "GET"], {"Allow": "GET"}),
    "too_large": (413, {"limit": "BLOCKGRAD_MAX_BODY_BYTES", "allowed": 32 * 1024 * 1024}, ["33554432"], {}),
    "limit_exceeded": (413, {"limit": "BLOCKGRAD_MAX_N", "value": 8193, "allowed": 8192},
                       ["BLOCKGRAD_MAX_N", "8192"], {}),
    "unsupported_media_type": (415, {}, ["application/json"], {}),
    "validation_error": (422, {"fields": {"factor": ["Must be between 1 and N = 3."]}}, ["factor"], {}),
    "non_finite_result": (422, {"block": {"row": 0, "col": 1}}, ["float64"], {}),
    "internal_error": (500, {}, [], {}),
    "deadline_exceeded": (503, {"timeout_s": 60.0}, ["60 s"], {"Retry-After": ""}),
    "device_out_of_memory": (503, {}, ["memory"], {"Retry-After": ""}),
    "not_ready": (503, {}, ["BLOCKGRAD_DEVICE=cuda"], {}),
    "read_timeout": (408, {"timeout_s": 30.0}, ["BLOCKGRAD_READ_TIMEOUT_S"], {}),
    "overloaded": (503, {"queue_depth": 4}, ["BLOCKGRAD_QUEUE_DEPTH"], {"Retry-After": ""}),
    "client_closed": (499, {}, [], {}),
}


def test_every_code_has_a_trigger_and_a_contract():
    assert set(TRIGGERS) == set(ERRORS) == set(CONTRACT)


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
def test_the_service_sends_what_the_contract_says(code, monkeypatch):
    if code == "not_ready" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    settings, send, patches, style = TRIGGERS[code]
    client = create_app({"TESTING": True, **settings}).test_client()
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
