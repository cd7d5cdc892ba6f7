"""The one error table: every code's documented example is exactly what the service sends for it."""
import pytest
import torch
from gunicorn.http.errors import InvalidChunkSize
from werkzeug.exceptions import BadRequest, ClientDisconnected

from app import create_app
from app.api.v2.views import ERROR_STYLE as V2_STYLE
from app.core.errors import client_closed
from app.core.gate import Gate
from app.core.run import Deadline
from app.http.docs import error_example
from app.http.errors import ERROR_CODE_HEADER, ERRORS, bounded, not_found, service_routes

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


class RunningJobs:
    """A job store whose every job is still running."""

    def __init__(self, settings):
        pass

    def result(self, job_id):
        from app.jobs.errors import job_not_done

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
    "internal_error": ({}, post_v1(), [("app.api.v1.views.run", fail_with(RuntimeError("boom")))], None),
    "deadline_exceeded": ({}, post_v1(), [("app.core.run.Deadline", ExpiredDeadline)], None),
    "device_out_of_memory": ({}, post_v1(), [("app.core.run.load_vectors",
                                              fail_with(torch.OutOfMemoryError("out of memory")))], None),
    "not_ready": ({"BLOCKGRAD_DEVICE": "cuda"}, lambda c: c.get("/readyz"), [], None),
    "read_timeout": ({}, post_v1(), [("app.http.parsing.ReadAlarm", FiredAlarm),
                                     ("app.http.parsing.Request.get_data", fail_with(ClientDisconnected()))], None),
    "overloaded": ({}, post_v1(), [("app.http.slot.current_gate", full_gate)], None),
    "client_closed": ({}, post_v1(), [("app.core.run.Deadline", ClientGone)], None),
    "job_not_found": ({}, lambda c: c.get("/v1/jobs/nope"), [], None),
    "job_not_done": ({}, lambda c: c.get(f"/v1/jobs/{'0' * 32}/result"), [("app.api.v1.jobs.JobStore", RunningJobs)],
                     None),
    "cluster_unavailable": ({"BLOCKGRAD_DASK_SCHEDULER": "tcp://127.0.0.1:1"}, lambda c: c.get(f"/v1/jobs/{'0' * 32}"),
                            [], None),
}


def test_every_code_has_a_trigger():
    assert set(TRIGGERS) == set(ERRORS)


@pytest.mark.parametrize("code", sorted(TRIGGERS))
def test_documented_example_is_what_the_service_sends(code, monkeypatch):
    if code == "not_ready" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    settings, send, patches, style = TRIGGERS[code]
    client = create_app({"TESTING": True, **settings}).test_client()
    for target, value in patches:
        monkeypatch.setattr(target, value)
    response = send(client)
    expected = error_example(code, style) if style else error_example(code)
    if code == "not_found":  # the example lists a few routes; a live answer lists this app's
        expected = {"value": {"error": {"code": "not_found", "message": not_found(
            "/v1/gradient", service_routes(client.application)).message,
            "details": bounded({"routes": service_routes(client.application)})}}}  # a long list is cut
        assert expected["value"]["error"]["message"].startswith(
            error_example(code)["value"]["error"]["message"].split(";")[0])
    assert response.status_code == (style.status(ERRORS[code].status) if style else ERRORS[code].status)
    assert response.get_json() == expected["value"]
    assert response.headers[ERROR_CODE_HEADER] == code


def test_v2_documents_the_same_codes_in_its_own_shape():
    spec = create_app({"TESTING": True}).test_client().get("/openapi.json").get_json()
    infer = spec["paths"]["/v2/models/{model}/infer"]["post"]["responses"]
    examples = infer["400"]["content"]["application/json"]["examples"]
    assert examples["validation_error"]["value"] == {"error": "The request is not valid; fix these fields: factor."}
    assert set(examples) >= {"bad_json", "validation_error", "non_finite_result"}  # 422s answered as 400
