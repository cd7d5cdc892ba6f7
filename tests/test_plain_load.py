"""/v1's plain-document path (schemas.load_plain) answers exactly what the schema answers, and
declines every document the schema would treat otherwise (the schema then refuses it)."""
import numpy as np
import pytest
from marshmallow import ValidationError

from app.api.v1.schemas import GradientRequestSchema, load_plain
from app.core.errors import BlockgradError
from app.core.objectives import OBJECTIVES

SCHEMA = GradientRequestSchema()


@pytest.fixture(autouse=True)
def in_app(app):
    """The schema reads the app's objectives (built-ins here: the same as OBJECTIVES)."""
    with app.app_context():
        yield
V = [[0.5, -1.0], [2.0, 0.25], [1.5, 3.0]]

TAKEN = [
    {"vectors": V},
    {"vectors": V, "factor": 2},
    {"vectors": [[1, 2, 3]], "factor": 1},  # integers
    {"vectors": V, "factor": 3, "objective": "logsumexp", "offset": 0.25, "outputs": ["losses", "blocks", "losses"],
     "dtype": "float64"},
    {"vectors": V, "offset": 7},
    {"vectors": V, "offset": -(2 ** 53)},
    {"vectors": V, "outputs": ["accumulated"], "objective": "mean"},
    {"vectors": [[1e39, 0.0]], "dtype": "float32"},  # overflows float32: build_request refuses it on both paths
    {"vectors": V, "offset": 1e39, "dtype": "float32"},  # the offset overflows
    {"vectors": V, "dtype": "float32", "objective": "l2_norm", "factor": 1},
]

DECLINED = [
    [V], "x", None,
    {"vectors": V, "extra": 1},
    {"factor": 1},
    {"vectors": V, "factor": True}, {"vectors": V, "factor": 2.0}, {"vectors": V, "factor": "2"},
    {"vectors": V, "factor": None}, {"vectors": V, "factor": 0}, {"vectors": V, "factor": -1},
    {"vectors": V, "factor": 4},
    {"vectors": V, "objective": "nope"}, {"vectors": V, "objective": 5}, {"vectors": V, "objective": None},
    {"vectors": V, "offset": "5"}, {"vectors": V, "offset": True}, {"vectors": V, "offset": None},
    {"vectors": V, "offset": float("inf")}, {"vectors": V, "offset": float("nan")}, {"vectors": V, "offset": 2 ** 53 + 1},
    {"vectors": V, "outputs": []}, {"vectors": V, "outputs": ["x"]}, {"vectors": V, "outputs": "blocks"},
    {"vectors": V, "outputs": [1]}, {"vectors": V, "outputs": None},
    {"vectors": V, "dtype": "float16"}, {"vectors": V, "dtype": None},
    {"vectors": []}, {"vectors": [[]]}, {"vectors": [[1.0], [1.0, 2.0]]}, {"vectors": [[True]]},
    {"vectors": [["1"]]}, {"vectors": [[None]]}, {"vectors": [[float("inf")]]}, {"vectors": [[10 ** 400]]},
    {"vectors": None}, {"vectors": [1.0, 2.0]},
]


def outcome(load, document):
    """What loading gives: the request's fields, or the error's code, message and details."""
    try:
        req = load(document)
    except BlockgradError as exc:
        return ("error", exc.code, exc.message, exc.details)
    except ValidationError as exc:
        return ("schema refused", exc.messages)
    assert req is not None
    return ("request", req.vectors.dtype, req.vectors.tolist(), req.factor, req.objective, type(req.offset),
            req.offset, req.outputs, req.dtype, req.objective_fn)


@pytest.mark.parametrize("document", TAKEN, ids=range(len(TAKEN)))
def test_a_plain_document_loads_as_the_schema_loads_it(document):
    plain = outcome(lambda d: load_plain(d, OBJECTIVES), document)
    assert plain == outcome(SCHEMA.load, document)
    assert plain[0] in ("request", "error")


def test_the_plain_path_keeps_the_numbers_bit_for_bit():
    document = {"vectors": [[0.1, 1 / 3], [2 ** -1074, -0.0]]}
    np.testing.assert_array_equal(load_plain(document, OBJECTIVES).vectors, SCHEMA.load(document).vectors)
    assert np.signbit(load_plain(document, OBJECTIVES).vectors[1, 1])


@pytest.mark.parametrize("document", DECLINED, ids=range(len(DECLINED)))
def test_anything_else_is_left_to_the_schema(document):
    assert load_plain(document, OBJECTIVES) is None


def test_the_service_answers_declined_documents_with_the_schemas_errors(client):
    response = client.post("/v1/gradients", json={"vectors": V, "factor": True})
    assert response.status_code == 422 and response.get_json()["error"]["code"] == "validation_error"
    assert "factor" in response.get_json()["error"]["details"]["fields"]
