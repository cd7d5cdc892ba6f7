"""The one request pipeline: each front end call is admitted once, from its sizes, before its
numbers are converted; /v2's flat data becomes one array; and the frictions it fixes."""
import numpy as np
import orjson
import pytest
import torch

import app.http.pipeline as pipeline
from app import create_app
from tools.reference import reference_accumulated

from .test_api import assert_error, strict_json

INFER = "/v2/models/blockgrad/infer"
VECTORS = [[0.5, -1.0], [2.0, 0.25], [1.5, 3.0]]


def v2_body(data, shape=(3, 2), **parameters):
    return {"inputs": [{"name": "vectors", "shape": list(shape), "datatype": "FP64", "data": data}],
            "parameters": parameters, "outputs": [{"name": "accumulated"}]}


@pytest.fixture
def admissions(monkeypatch):
    """Every call of the one admission function, with the sizes it got."""
    calls = []
    real = pipeline.admit

    def counted(sizes, answer, settings, lanes=1):
        calls.append(sizes)
        return real(sizes, answer, settings, lanes)
    monkeypatch.setattr(pipeline, "admit", counted)
    return calls


def test_each_front_end_admits_once_with_the_sizes_sent(client, admissions):
    response = client.post("/v1/gradients", json={"vectors": VECTORS, "factor": 2, "outputs": ["accumulated"],
                                                  "dtype": "float64", "objective": "logsumexp"})
    assert response.status_code == 200
    assert [(s.n, s.dim, s.factor, s.outputs, s.objective, s.dtype) for s in admissions] == [
        (3, 2, 2, ("accumulated",), "logsumexp", "float64")]
    response = client.post(INFER, json=v2_body(sum(VECTORS, []), factor=3, objective="mean"))
    assert response.status_code == 200
    assert [(s.n, s.dim, s.factor, s.outputs, s.objective, s.dtype) for s in admissions[1:]] == [
        (3, 2, 3, ("accumulated",), "mean", "float64")]


def test_run_itself_does_not_admit(monkeypatch):
    """The engine call computes what the pipeline admitted: no admission function is reached from it."""
    import app.core.admission as admission
    from app.core.request import GradientRequest
    from app.core.run import run
    from app.core.settings import Settings

    for name in ("admit", "check_shape", "check_block_and_answer", "check_activations"):
        monkeypatch.setattr(admission, name, lambda *args, **kwargs: pytest.fail("run admitted again"))
    req = GradientRequest(vectors=np.array(VECTORS), factor=1, objective="sum", offset=5.0,
                          outputs=("accumulated",), dtype="float64")
    # Over BLOCKGRAD_MAX_BLOCK_ELEMENTS = 1: admission would refuse it; run computes it.
    result = run(req, Settings(device="cpu", max_block_elements=1))
    expected = reference_accumulated(torch.tensor(VECTORS, dtype=torch.float64), 1, "sum")
    np.testing.assert_array_equal(result.accumulated.numpy(), expected.numpy())


def test_a_refusal_from_the_sizes_converts_no_number(client, admissions, monkeypatch):
    monkeypatch.setattr("app.core.vectors.parse_matrix", lambda *args: pytest.fail("converted numbers"))
    monkeypatch.setattr("app.core.vectors.parse_flat", lambda *args: pytest.fail("converted numbers"))
    assert_error(client.post("/v1/gradients", json={"vectors": [[0.0]] * 9000}), 413, "limit_exceeded")
    response = client.post(INFER, json=v2_body([0.0] * 9000, shape=(9000, 1)))
    assert response.status_code == 413 and "BLOCKGRAD_MAX_N" in strict_json(response.get_data())["error"]
    assert [s.n for s in admissions] == [9000, 9000]


def test_v2_flat_data_goes_to_one_array_without_row_lists(client, monkeypatch):
    monkeypatch.setattr("app.core.vectors.parse_matrix", lambda *args: pytest.fail("built row lists"))
    flat = client.post(INFER, json=v2_body(sum(VECTORS, [])))
    monkeypatch.undo()
    nested = client.post(INFER, json=v2_body(VECTORS))
    assert flat.status_code == nested.status_code == 200
    assert strict_json(flat.get_data())["outputs"] == strict_json(nested.get_data())["outputs"]
    expected = reference_accumulated(torch.tensor(VECTORS, dtype=torch.float64), 1, "sum").reshape(-1)
    assert strict_json(flat.get_data())["outputs"][0]["data"] == expected.tolist()


def test_v2_flat_data_names_the_cell_as_v1_does(client):
    response = client.post(INFER, json=v2_body([0.5, -1.0, 2.0, "x", 1.5, 3.0]))
    assert response.status_code == 400
    assert strict_json(response.get_data())["error"] == ("Input 'vectors': Row 1, column 1 is a string; "
                                                         "only numbers are allowed.")


def test_v1_reads_a_body_without_content_type_as_json(client):
    response = client.post("/v1/gradients", data=orjson.dumps({"vectors": VECTORS, "outputs": ["accumulated"]}))
    assert response.status_code == 200
    expected = reference_accumulated(torch.tensor(VECTORS, dtype=torch.float32), 1, "sum")
    np.testing.assert_array_equal(np.array(strict_json(response.get_data())["accumulated"]), expected.numpy())
    for other in ("text/plain", "application/x-www-form-urlencoded", "application/octet-stream"):
        assert_error(client.post("/v1/gradients", data=orjson.dumps({"vectors": VECTORS}), content_type=other),
                     415, "unsupported_media_type")


def test_a_job_body_without_content_type_is_read_as_json_too(client):
    """POST /v1/jobs takes /v1's body rules: no Content-Type is JSON (here refused by its field
    rules before any cluster is asked), other types 415."""
    error = assert_error(client.post("/v1/jobs", data=orjson.dumps({"vectors": VECTORS, "outputs": ["blocks"]})),
                         422, "validation_error")
    assert "outputs" in error["details"]["fields"]
    assert_error(client.post("/v1/jobs", data=orjson.dumps({"vectors": VECTORS}), content_type="text/plain"),
                 415, "unsupported_media_type")


@pytest.mark.parametrize("factor", [0, -1, 4])
def test_a_factor_out_of_range_gets_one_message_naming_n(client, factor):
    error = assert_error(client.post("/v1/gradients", json={"vectors": VECTORS, "factor": factor}),
                         422, "validation_error")
    assert error["details"]["fields"] == {"factor": ["Must be between 1 and N = 3."]}
    response = client.post(INFER, json=v2_body(sum(VECTORS, []), factor=factor))
    assert response.status_code == 400
    assert strict_json(response.get_data())["error"] == "Parameter 'factor': Must be between 1 and N = 3."


def test_a_factor_under_one_without_valid_vectors_still_names_the_bound(client):
    error = assert_error(client.post("/v1/gradients", json={"vectors": "x", "factor": 0}), 422, "validation_error")
    assert error["details"]["fields"]["factor"] == ["Must be at least 1."]
    assert "vectors" in error["details"]["fields"]


def test_a_refused_v2_request_logs_its_sizes_under_v2_names(caplog):
    import logging

    from .test_request_log import request_lines

    caplog.set_level(logging.INFO, logger="blockgrad")
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_BLOCK_ELEMENTS": "10"}).test_client()
    body = dict(v2_body(sum(VECTORS, []), factor=1), outputs=[{"name": "block_gradients"}, {"name": "bounds"}])
    assert client.post(INFER, json=body).status_code == 413
    [line] = request_lines(caplog)
    assert (line["n"], line["dim"], line["factor"], line["error"]) == (3, 2, 1, "limit_exceeded")
    assert line["outputs"] == ["block_gradients", "bounds"]


class SubmittedJobs:
    """The job store's submit, recorded: the pipeline's execute step for POST /v1/jobs."""

    def __init__(self, settings):
        self.settings = settings  # the job limits the admit step reads
        self.submitted = []

    def submit(self, req, idempotency_key=None):
        self.submitted.append((req, idempotency_key))
        return {"id": "f" * 32, "status": "queued"}, True


def test_a_job_post_goes_through_the_one_pipeline_to_submit(monkeypatch):
    """Admitted once by the job's own limits (BLOCKGRAD_MAX_JOB_N, not /v1's BLOCKGRAD_MAX_N),
    converted, then handed to the store's submit with its Idempotency-Key; a job over its
    limits is refused before any number is converted and never submitted."""
    from dataclasses import replace

    from app.extensions import install_services, services_of

    app = create_app({"TESTING": True, "BLOCKGRAD_MAX_N": "2", "BLOCKGRAD_MAX_JOB_N": "3"})
    jobs = SubmittedJobs(services_of(app).jobs.settings)
    install_services(app, replace(services_of(app), jobs=jobs))
    client = app.test_client()
    response = client.post("/v1/jobs", json={"vectors": VECTORS, "factor": 3}, headers={"Idempotency-Key": "k1"})
    assert response.status_code == 202 and response.headers["Location"] == "/v1/jobs/" + "f" * 32
    [(req, key)] = jobs.submitted
    assert (req.n, req.dim, req.factor, req.outputs, key) == (3, 2, 3, ("accumulated", "losses"), "k1")
    np.testing.assert_array_equal(req.vectors, np.array(VECTORS))
    monkeypatch.setattr("app.core.vectors.parse_matrix", lambda *args: pytest.fail("converted numbers"))
    error = assert_error(client.post("/v1/jobs", json={"vectors": VECTORS * 2}), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_MAX_JOB_N"
    assert len(jobs.submitted) == 1
