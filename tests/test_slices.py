"""Large /v1 bodies parsed a slice at a time (app/http/body.py): the same document as one
orjson parse, or None (the caller then parses at once) whenever the cut could be wrong."""
import json

import numpy as np
import orjson
import pytest

from app.http import body as slices
from app.http.body import loads_sliced

ROWS = np.random.default_rng(1).standard_normal((3000, 200)).tolist()  # ~11 MiB as JSON
PAD = "x" * (5 * 1024 * 1024)  # makes small documents large enough to be sliced


@pytest.mark.parametrize("document", [
    {"vectors": ROWS, "factor": 30},
    {"factor": 8, "outputs": ["accumulated"], "vectors": ROWS[:2000], "objective": "sum"},
    {"vectors": [[1, "],"], [2]], "pad": PAD},  # a string holding a row end: still the same document
])
@pytest.mark.parametrize("indent", [False, True])
def test_same_document_as_one_parse(document, indent):
    body = json.dumps(document, indent=2 if indent else None).encode()
    assert len(body) > slices.SLICED_ABOVE
    assert loads_sliced(body) == orjson.loads(body)


@pytest.mark.parametrize("body", [
    json.dumps({"meta": {"vectors": [[1, 2]]}, "vectors": None, "pad": PAD}).encode(),  # nested key first
    json.dumps({"vectors": [[1, "]]"]], "pad": PAD}).encode(),
    json.dumps({"pad": PAD, "vectors": [[1, 2]]}).encode()[:-3],  # truncated
    b'{"vectors": [[1, 2]], "vectors": [[3]], "pad": "' + PAD.encode() + b'"}',  # duplicate keys
    json.dumps({"pad": PAD}).encode(),  # no vectors
    json.dumps({"vectors": [[1, 2]]}).encode(),  # small: parsed at once
])
def test_anything_unusual_is_left_to_the_one_shot_parse(body):
    result = loads_sliced(body)
    assert result is None or result == orjson.loads(body)


def test_a_large_body_through_the_api(client, monkeypatch):
    import app.http.body as parsing

    sliced = []
    monkeypatch.setattr(parsing, "loads_sliced", lambda body: sliced.append(loads_sliced(body)) or sliced[-1])
    vectors = np.random.default_rng(2).standard_normal((128, 4096)).round(6)  # over SLICED_ABOVE, few pairs
    body = orjson.dumps({"vectors": vectors.tolist(), "factor": 16, "outputs": ["accumulated"], "dtype": "float64"})
    assert len(body) > slices.SLICED_ABOVE
    response = client.post("/v1/gradients", data=body, content_type="application/json")
    assert response.status_code == 200
    assert sliced and sliced[0] is not None  # the body went through the sliced parse
    # sum objective: every accumulated entry is 2N (each vector is in N row and N column pairs)
    assert np.all(np.array(response.get_json()["accumulated"]) == 2 * 128)
