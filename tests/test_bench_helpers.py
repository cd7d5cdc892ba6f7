"""The benchmark's in-process helpers still match the service's code paths (`make bench` is
not run by CI, so a refactor that breaks it would go unnoticed until the next run)."""
import numpy as np
import orjson

from bench import inprocess


def test_parse_and_validate_builds_the_request_the_view_gets():
    body = orjson.dumps({"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 3})
    req = inprocess.parse_and_validate(body)
    assert (req.n, req.dim, req.factor) == (3, 2, 3)
    assert req.vectors.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_floor_body_is_the_answer_json():
    req = inprocess.request(np.array([[1.0, 2.0], [3.0, 4.0]]), 2)
    answer = orjson.loads(inprocess.floor_body(req))
    assert answer["bounds"] == [0, 1, 2] and len(answer["blocks"]) == 4
    assert answer["accumulated"] == [[4.0, 4.0], [4.0, 4.0]]  # sum: each vector in 2N entries
