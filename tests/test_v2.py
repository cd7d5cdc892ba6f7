"""The Open Inference Protocol (/v2) through the Flask test client.

Binary bodies are built and read here byte by byte with struct, following the
binary tensor data extension, independently of app/api/v2/codec.py. Numbers are
compared with tools/reference.py (the seed's loops) and with /v1/gradients.
"""
import gzip
import io
import json
import math
import struct

import numpy as np
import orjson
import pytest
import torch

from app import create_app
from app.http.sending import gather

from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches

INFER = "/v2/models/blockgrad/infer"
HEADER = "Inference-Header-Content-Length"
FORMATS = {"FP32": "f", "FP64": "d", "INT64": "q"}  # struct codes, used with "<" (little-endian)
NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64}
TORCH = {"FP32": torch.float32, "FP64": torch.float64}


def strict_json(data: bytes):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(data, parse_constant=refuse)


def vectors_input(shape, datatype="FP32", data=None, parameters=None):
    tensor = {"name": "vectors", "shape": list(shape), "datatype": datatype}
    if data is not None:
        tensor["data"] = data
    if parameters is not None:
        tensor["parameters"] = parameters
    return tensor


def binary_request(values: np.ndarray, datatype="FP32", parameters=None, outputs=None, extra=None):
    """Body and headers of a request whose input is binary tensor data, built with struct."""
    n, d = values.shape
    flat = [float(x) for x in values.reshape(-1)]
    data = struct.pack(f"<{n * d}{FORMATS[datatype]}", *flat)
    document = {"inputs": [vectors_input((n, d), datatype, parameters={"binary_data_size": len(data)})]}
    if parameters is not None:
        document["parameters"] = parameters
    if outputs is not None:
        document["outputs"] = outputs
    document.update(extra or {})
    header = json.dumps(document).encode()
    return header + data, {HEADER: str(len(header)), "Content-Type": "application/octet-stream"}


def read_response(response) -> tuple[dict, dict[str, np.ndarray]]:
    """Header and tensors of a response, binary parts read with struct in header order."""
    streamed = response.is_streamed  # before get_data, which turns the stream into a list
    body = response.get_data()
    if HEADER not in response.headers:
        assert response.mimetype == "application/json"
        # All-JSON answers are streamed, so their length is not known up front.
        assert streamed and "Content-Length" not in response.headers
        header, offset = strict_json(body), len(body)
    else:
        assert response.mimetype == "application/octet-stream"
        offset = int(response.headers[HEADER])
        header = strict_json(body[:offset])
        assert int(response.headers["Content-Length"]) == len(body)
    tensors = {}
    for output in header["outputs"]:
        shape, datatype = output["shape"], output["datatype"]
        count = math.prod(shape)
        if "data" in output:
            assert "parameters" not in output or "binary_data_size" not in output["parameters"]
            values = np.array(output["data"], dtype=NUMPY[datatype])
        else:
            size = output["parameters"]["binary_data_size"]
            assert size == count * struct.calcsize(FORMATS[datatype])
            values = np.array(struct.unpack_from(f"<{count}{FORMATS[datatype]}", body, offset), dtype=NUMPY[datatype])
            offset += size
        assert output["name"] not in tensors, f"output {output['name']} twice"
        tensors[output["name"]] = values.reshape(shape)
    assert offset == len(body), "bytes left over after the last binary output"
    return header, tensors


def reference_outputs(vectors: torch.Tensor, factor: int, objective: str, offset: float, bounds: list[int]):
    """What every output must hold, from the seed's loops."""
    n, d = vectors.shape
    grid = torch.empty((n, n, 2 * d), dtype=vectors.dtype)
    losses = torch.empty((factor, factor), dtype=vectors.dtype)
    for k, (loss, grad) in enumerate(reference_blocks(vectors, factor, objective, offset)):
        r, c = divmod(k, factor)
        grid[bounds[r]:bounds[r + 1], bounds[c]:bounds[c + 1]] = grad
        losses[r, c] = loss
    return {"block_gradients": grid, "accumulated": reference_accumulated(vectors, factor, objective, offset),
            "losses": losses, "bounds": torch.tensor(bounds)}


ALL_OUTPUTS = ["block_gradients", "accumulated", "bounds", "losses"]  # the default, in the contract's order


def assert_matches_reference(tensors, expected, datatype, names):
    """Exactly the outputs `names`, in that order, each equal to the reference's."""
    assert list(tensors) == names
    for name, array in tensors.items():
        if name == "bounds":
            assert array.dtype == np.int64 and array.tolist() == expected["bounds"].tolist()
        else:
            assert array.dtype == NUMPY[datatype]
            assert_matches(array, expected[name], datatype, what=name)


GOOD = {"inputs": [vectors_input((3, 2), data=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])], "parameters": {"factor": 2}}


# GOOD's answer, written out: V = [[1, 2], [3, 4], [5, 6]] (row sums 3, 7, 11), F = 2, sum with
# offset 5: every gradient entry is 1, each entry of V is in 2N = 6 pairs, and block (r, c)'s
# loss sums s_i + s_j + 4 * 5 over its pairs (i, j): 26; 30 + 34; 30 + 34; 34 + 38 + 38 + 42.
GOOD_ANSWER = {"block_gradients": np.ones((3, 3, 4)), "accumulated": np.full((3, 2), 6.0),
               "bounds": [0, 1, 3], "losses": [[26.0, 64.0], [64.0, 152.0]]}


def assert_good_answer(response, names=ALL_OUTPUTS, answer=GOOD_ANSWER):
    """Exactly `names` of GOOD's answer (every number exact in float32), in that order."""
    assert response.status_code == 200, response.get_data()
    _, tensors = read_response(response)
    assert list(tensors) == names
    for name, array in tensors.items():
        assert array.dtype == (np.int64 if name == "bounds" else np.float32), name
        assert array.tolist() == np.asarray(answer[name]).tolist(), name


def assert_still_serving(client):
    assert_good_answer(client.post(INFER, json=GOOD))


# ---------------------------------------------------------------- metadata and health


def test_server_metadata(client):
    response = client.get("/v2")
    assert response.status_code == 200
    body = strict_json(response.get_data())
    assert body["name"] == "blockgrad" and isinstance(body["version"], str)
    assert "binary_tensor_data" in body["extensions"]


@pytest.mark.parametrize("url", ["/v2/health/live", "/v2/health/ready", "/v2/models/blockgrad/ready",
                                 "/v2/models/blockgrad/versions/1/ready"])
def test_health_is_status_with_empty_body(client, url):
    response = client.get(url)
    assert response.status_code == 200 and response.get_data() == b""


def test_not_ready_is_a_4xx_with_empty_body():
    client = create_app({"BLOCKGRAD_DEVICE": "tpu"}).test_client()
    assert client.get("/v2/health/live").status_code == 200
    for url in ["/v2/health/ready", "/v2/models/blockgrad/ready"]:
        response = client.get(url)
        assert response.status_code == 400 and response.get_data() == b""


FLOATS = ["FP32", "FP64"]  # the input takes either; the float outputs follow it


@pytest.mark.parametrize("url", ["/v2/models/blockgrad", "/v2/models/blockgrad/versions/1"])
def test_model_metadata(client, url):
    response = client.get(url)
    assert response.status_code == 200
    assert strict_json(response.get_data()) == {
        "name": "blockgrad", "versions": ["1"], "platform": "pytorch",
        "inputs": [{"name": "vectors", "datatype": "FP32", "datatypes": FLOATS, "shape": [-1, -1]}],
        "outputs": [
            {"name": "block_gradients", "datatype": "FP32", "datatypes": FLOATS, "shape": [-1, -1, -1]},
            {"name": "accumulated", "datatype": "FP32", "datatypes": FLOATS, "shape": [-1, -1]},
            {"name": "bounds", "datatype": "INT64", "datatypes": ["INT64"], "shape": [-1]},
            {"name": "losses", "datatype": "FP32", "datatypes": FLOATS, "shape": [-1, -1]},
        ],
    }


@pytest.mark.parametrize("method,url,status", [
    ("get", "/v2/models/other", 404), ("get", "/v2/models/other/ready", 404),
    ("get", "/v2/models/blockgrad/versions/2", 404), ("post", "/v2/models/other/infer", 404),
    ("post", "/v2/models/blockgrad/versions/7/infer", 404), ("get", "/v2/nowhere", 404),
    ("get", INFER, 405), ("post", "/v2", 405),
])
def test_unknown_model_route_and_method(client, method, url, status):
    response = getattr(client, method)(url, json=GOOD if method == "post" else None)
    assert_protocol_error(response, status)
    assert_still_serving(client)


# ---------------------------------------------------------------- inference, JSON and binary


@pytest.mark.parametrize("nested", [False, True])
def test_json_infer_matches_reference(client, nested):
    vectors = torch.randn(7, 3, dtype=torch.float64).to(torch.float32)
    data = vectors.tolist() if nested else vectors.reshape(-1).tolist()
    response = client.post(INFER, json={
        "id": "req-1", "inputs": [vectors_input((7, 3), data=data)],
        "parameters": {"factor": 3, "objective": "logsumexp"}})
    assert response.status_code == 200
    header, tensors = read_response(response)
    assert header["model_name"] == "blockgrad" and header["id"] == "req-1"
    assert header["parameters"]["factor"] == 3 and header["parameters"]["objective"] == "logsumexp"
    assert [o["name"] for o in header["outputs"]] == ["block_gradients", "accumulated", "bounds", "losses"]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in header["outputs"]} == {
        "block_gradients": ("FP32", [7, 7, 6]), "accumulated": ("FP32", [7, 3]),
        "bounds": ("INT64", [4]), "losses": ("FP32", [3, 3])}
    assert tensors["bounds"].tolist() == [0, 2, 4, 7]  # base 7 // 3 = 2, the last block takes 3
    assert_matches_reference(tensors, reference_outputs(vectors, 3, "logsumexp", 5.0, [0, 2, 4, 7]), "FP32", ALL_OUTPUTS)


def test_seed_example_defaults(client):
    """10 x 5, default factor ceil(10 / 6) = 2 and objective sum: gradients all 1, accumulated all 20."""
    vectors = np.random.default_rng(0).standard_normal((10, 5))
    body, headers = binary_request(vectors, "FP32")
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200
    header, tensors = read_response(response)
    assert header["parameters"]["factor"] == 2 and header["parameters"]["objective"] == "sum"
    assert tensors["bounds"].tolist() == [0, 5, 10]
    assert np.all(tensors["block_gradients"] == 1.0) and tensors["block_gradients"].shape == (10, 10, 10)
    assert np.all(tensors["accumulated"] == 20.0)


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
@pytest.mark.parametrize("objective", ["sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"])
def test_binary_request_and_response_byte_by_byte(client, datatype, objective):
    vectors = torch.randn(9, 4, dtype=torch.float64).to(TORCH[datatype])
    body, headers = binary_request(vectors.numpy(), datatype,
                                   parameters={"factor": 4, "objective": objective, "offset": 1.5,
                                               "binary_data_output": True})
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    header, tensors = read_response(response)
    assert all("binary_data_size" in o["parameters"] for o in header["outputs"])
    assert tensors["bounds"].tolist() == [0, 2, 4, 6, 9]
    assert_matches_reference(tensors, reference_outputs(vectors, 4, objective, 1.5, [0, 2, 4, 6, 9]), datatype,
                             ALL_OUTPUTS)


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
@pytest.mark.parametrize("n,factor", [(8, 4), (9, 4), (12, 3)])
def test_broadcast_block_rows_are_written_as_the_reference_s_numbers(client, datatype, n, factor):
    """`mean` over blocks of one size (8 / 4, 12 / 3) makes every block row one number
    broadcast, written without being made; ragged blocks (9 / 4) give a row several numbers,
    copied into place. Either way the bytes are the reference's."""
    vectors = torch.randn(n, 3, dtype=torch.float64).to(TORCH[datatype])
    bounds = [k * (n // factor) for k in range(factor)] + [n]
    body, headers = binary_request(vectors.numpy(), datatype, parameters={
        "factor": factor, "objective": "mean", "binary_data_output": True})
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    _, tensors = read_response(response)
    expected = reference_outputs(vectors, factor, "mean", 5.0, bounds)["block_gradients"].numpy()
    assert tensors["block_gradients"].shape == expected.shape
    assert tensors["block_gradients"].tobytes() == expected.astype(NUMPY[datatype]).tobytes()


def test_a_broadcast_slab_is_written_as_its_number_repeated():
    """The bytes of the same slab made, little-endian, in pieces of whole numbers (the made
    slab's pieces are chunk_bytes: a piece length that is not tells the paths apart)."""
    from app.api.v2.codec import RowSlabs, iter_body
    for dtype, shape, chunk in ((np.float32, (5, 7, 6), 66), (np.float64, (3, 4, 2), 44),
                                (np.dtype(">f4"), (2, 3, 2), 10), (np.float32, (2, 2, 2), 1 << 20)):
        number = np.array([0.1], dtype=dtype)
        broadcast = RowSlabs(shape, np.dtype(dtype), lambda: iter([np.broadcast_to(number, shape)]))
        pieces = list(iter_body(iter([]), [broadcast], chunk))
        made = np.full(shape, number[0], dtype=np.dtype(dtype).newbyteorder("<"))
        assert b"".join(pieces) == made.tobytes()
        whole = chunk // made.itemsize * made.itemsize
        assert [len(piece) for piece in pieces[:-1]] == [whole] * (len(pieces) - 1)


def blocks_of(grads: dict, n: int, bounds: list[int]):
    """Blocks (row-block-major) with the given gradients, keyed (r, c)."""
    from app.core.engine import Block
    return [Block(r, c, (bounds[r], bounds[r + 1]), (bounds[c], bounds[c + 1]), torch.tensor(0.0), grads[r, c])
            for r in range(len(bounds) - 1) for c in range(len(bounds) - 1)]


def rows_of(blocks, n: int, dim: int) -> list[np.ndarray]:
    from types import SimpleNamespace

    from app.api.v2.infer import gradient_rows
    result = SimpleNamespace(request=SimpleNamespace(n=n, dim=dim), blocks=lambda: iter(blocks))
    return list(gradient_rows(result))


def test_block_rows_broadcast_only_one_and_the_same_number():
    n, dim, bounds = 5, 2, [0, 2, 5]  # ragged: 2 and 3 rows, 2 and 3 columns
    def same(value, r, c):
        return torch.tensor(value).expand(bounds[r + 1] - bounds[r], bounds[c + 1] - bounds[c], 2 * dim)
    grads = {(0, 0): same(0.0, 0, 0), (0, 1): same(-0.0, 0, 1),  # equal as numbers, not as bits
             (1, 0): same(0.5, 1, 0), (1, 1): same(0.5, 1, 1)}  # one number: broadcast
    rows = rows_of(blocks_of(grads, n, bounds), n, dim)
    assert [row.shape for row in rows] == [(2, 5, 4), (3, 5, 4)]
    assert any(rows[0].strides) and not any(rows[1].strides)
    assert np.signbit(rows[0][:, 2:]).all() and not np.signbit(rows[0][:, :2]).any()
    assert (rows[1] == 0.5).all()
    partly = {(0, 0): torch.randn(2, 1, 1).expand(2, 2, 4), (0, 1): torch.randn(2, 3, 4),
              (1, 0): same(1.0, 1, 0), (1, 1): torch.randn(3, 3, 4)}  # a dense block after a number
    rows = rows_of(blocks_of(partly, n, bounds), n, dim)
    assert all(any(row.strides) for row in rows)
    for (r, c), grad in partly.items():
        assert np.array_equal(rows[r][:, bounds[c]:bounds[c + 1]], grad.numpy())


def test_a_block_row_holds_no_dense_gradient_past_its_copy():
    """Each dense block is copied into its row's slab as it comes: of the ones before, only the
    last is alive (the loop's variable) when the next is made, not the row's (a block row may
    span many bands of chunks). Freed by reference counting: garbage collection is off meanwhile,
    so a block kept in a cycle stays alive and fails the assertion."""
    import gc
    import weakref

    from app.core.engine import Block
    n, dim, factor = 8, 2, 4
    alive = []

    def block(r, c):
        grad = torch.randn(2, 2, 2 * dim)
        alive.append(weakref.ref(grad))
        return Block(r, c, (2 * r, 2 * r + 2), (2 * c, 2 * c + 2), torch.tensor(0.0), grad)

    def blocks():
        for r in range(factor):
            for c in range(factor):
                assert sum(ref() is not None for ref in alive) <= 1, "copied blocks' gradients are still held"
                yield block(r, c)
    from types import SimpleNamespace

    from app.api.v2.infer import gradient_rows
    result = SimpleNamespace(request=SimpleNamespace(n=n, dim=dim), blocks=blocks)
    collecting = gc.isenabled()
    gc.disable()
    try:
        assert len(list(gradient_rows(result))) == factor
    finally:
        if collecting:
            gc.enable()


def test_binary_answer_equals_v1(client):
    """The same numbers, bit for bit, as /v1/gradients' JSON (shortest round-trip digits)."""
    vectors = np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32)
    body, headers = binary_request(vectors, parameters={"factor": 3, "objective": "sum_of_squares",
                                                        "binary_data_output": True})
    _, tensors = read_response(client.post(INFER, data=body, headers=headers))
    v1 = strict_json(client.post("/v1/gradients", json={
        "vectors": vectors.tolist(), "factor": 3, "objective": "sum_of_squares",
        "outputs": ["blocks", "accumulated", "losses"]}).get_data())
    assert tensors["bounds"].tolist() == v1["bounds"]
    assert np.array_equal(tensors["accumulated"], np.array(v1["accumulated"], dtype=np.float32))
    assert np.array_equal(tensors["losses"], np.array(v1["losses"], dtype=np.float32))
    for block in v1["blocks"]:
        (r0, r1), (c0, c1) = block["rows"], block["cols"]
        assert np.array_equal(tensors["block_gradients"][r0:r1, c0:c1], np.array(block["gradient"], dtype=np.float32))


def test_outputs_selection_order_and_binary_flags(client):
    vectors = np.arange(12, dtype=np.float64).reshape(4, 3) / 10
    body, headers = binary_request(vectors, "FP64", parameters={"factor": 2, "binary_data_output": True}, outputs=[
        {"name": "losses", "parameters": {"binary_data": False}},  # overrides binary_data_output
        {"name": "accumulated"},
    ])
    response = client.post(INFER, data=body, headers=headers)
    header, tensors = read_response(response)
    assert [o["name"] for o in header["outputs"]] == ["losses", "accumulated"]
    assert "data" in header["outputs"][0] and "binary_data_size" in header["outputs"][1]["parameters"]
    expected = reference_outputs(torch.from_numpy(vectors), 2, "sum", 5.0, [0, 2, 4])
    assert_matches_reference(tensors, expected, "FP64", ["losses", "accumulated"])


def test_only_json_outputs_give_a_json_body(client):
    response = client.post(INFER, json=dict(GOOD, outputs=[{"name": "bounds"}, {"name": "accumulated"}]))
    assert response.mimetype == "application/json" and HEADER not in response.headers
    header, tensors = read_response(response)
    assert set(tensors) == {"bounds", "accumulated"}
    assert tensors["accumulated"].tolist() == [[6.0, 6.0]] * 3


def test_one_binary_output_from_a_json_request(client):
    response = client.post(INFER, json=dict(GOOD, outputs=[{"name": "bounds", "parameters": {"binary_data": True}}]))
    body = response.get_data()
    length = int(response.headers[HEADER])
    assert struct.unpack("<3q", body[length:]) == (0, 1, 3)


def test_versioned_infer_and_body_model_name(client):
    response = client.post("/v2/models/blockgrad/versions/1/infer",
                           json=dict(GOOD, model_name="blockgrad", outputs=[{"name": "bounds"}]))
    assert response.status_code == 200
    assert read_response(response)[1]["bounds"].tolist() == [0, 1, 3]


# ---------------------------------------------------------------- JSON outputs are streamed


def test_large_json_answer_is_streamed_in_bounded_chunks_and_equals_binary_and_v1(client):
    """N = 64, D = 16, FP64: block_gradients alone is 131,072 numbers, over 2 MiB of text,
    so the body comes in several chunks, none near the whole document."""
    from app.api.v2.codec import CHUNK_BYTES

    vectors = np.random.default_rng(4).standard_normal((64, 16))
    parameters = {"factor": 5, "objective": "sum_of_squares"}
    response = client.post(INFER, json={"inputs": [vectors_input((64, 16), "FP64", data=vectors.tolist())],
                                        "parameters": parameters})
    assert response.status_code == 200 and response.is_streamed
    assert response.mimetype == "application/json" and "Content-Length" not in response.headers
    chunks = list(response.response)  # as the app yields them to the WSGI server
    body = b"".join(chunks)
    assert len(body) > 2 * CHUNK_BYTES and len(chunks) > 2
    assert max(len(chunk) for chunk in chunks) < 2 * CHUNK_BYTES
    header = strict_json(body)  # one standard JSON document
    json_tensors = {o["name"]: np.array(o["data"], dtype=NUMPY[o["datatype"]]).reshape(o["shape"])
                    for o in header["outputs"]}
    assert [o["name"] for o in header["outputs"]] == ["block_gradients", "accumulated", "bounds", "losses"]

    body, headers = binary_request(vectors, "FP64", parameters=dict(parameters, binary_data_output=True))
    _, binary_tensors = read_response(client.post(INFER, data=body, headers=headers))
    for name, array in binary_tensors.items():
        assert json_tensors[name].dtype == array.dtype and np.array_equal(json_tensors[name], array), name

    v1 = strict_json(client.post("/v1/gradients", json={
        "vectors": vectors.tolist(), "dtype": "float64", **parameters,
        "outputs": ["blocks", "accumulated", "losses"]}).get_data())
    assert json_tensors["bounds"].tolist() == v1["bounds"]
    assert np.array_equal(json_tensors["accumulated"], np.array(v1["accumulated"]))
    assert np.array_equal(json_tensors["losses"], np.array(v1["losses"]))
    for block in v1["blocks"]:
        (r0, r1), (c0, c1) = block["rows"], block["cols"]
        assert np.array_equal(json_tensors["block_gradients"][r0:r1, c0:c1], np.array(block["gradient"]))


@pytest.mark.parametrize("slice_numbers", [1, 2, 3, 7, 1000])
def test_json_pieces_join_into_the_one_document(monkeypatch, slice_numbers):
    """Whatever the slice size, the pieces are exactly orjson's serialisation of the whole answer."""
    import orjson

    from app.api.v2 import codec

    monkeypatch.setattr(codec, "JSON_SLICE_NUMBERS", slice_numbers)
    tensors = [codec.OutputTensor("block_gradients", "FP32", np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
                                  False),
               codec.OutputTensor("bounds", "INT64", np.array([0, 1, 3], dtype=np.int64), True),
               codec.OutputTensor("losses", "FP64", np.array([[1e-300, -2.5], [3.0, 1e300]]), False),
               codec.OutputTensor("accumulated", "FP64", np.array([[0.1]]), False)]
    head = {"model_name": "blockgrad", "model_version": "1", "parameters": {"factor": 2, "offset": 5.0}}
    expected = {**head, "outputs": [
        {"name": "block_gradients", "datatype": "FP32", "shape": [2, 3, 4], "data": tensors[0].array.reshape(-1)},
        {"name": "bounds", "datatype": "INT64", "shape": [3], "parameters": {"binary_data_size": 24}},
        {"name": "losses", "datatype": "FP64", "shape": [2, 2], "data": tensors[2].array.reshape(-1)},
        {"name": "accumulated", "datatype": "FP64", "shape": [1, 1], "data": tensors[3].array.reshape(-1)}]}
    pieces = list(codec.iter_json(head, tensors))
    assert b"".join(pieces) == orjson.dumps(expected, option=orjson.OPT_SERIALIZE_NUMPY)
    assert b"".join(gather(iter(pieces), chunk_bytes=16)) == b"".join(pieces)


def test_mixed_json_and_binary_outputs_with_a_large_json_one(client):
    """A binary output after a JSON one bigger than a slice: the header, built whole, is
    exactly Inference-Header-Content-Length long and holds the JSON output's data."""
    vectors = np.random.default_rng(5).standard_normal((48, 8)).astype(np.float32)
    body, headers = binary_request(vectors, parameters={"factor": 3}, outputs=[
        {"name": "block_gradients"}, {"name": "accumulated", "parameters": {"binary_data": True}}])
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200 and HEADER in response.headers
    header, tensors = read_response(response)
    assert "data" in header["outputs"][0] and "binary_data_size" in header["outputs"][1]["parameters"]
    expected = reference_outputs(torch.from_numpy(vectors), 3, "sum", 5.0, [0, 16, 32, 48])
    assert_matches_reference(tensors, expected, "FP32", ["block_gradients", "accumulated"])


# ---------------------------------------------------------------- bad input: status and {"error": ...}


def assert_protocol_error(response, status):
    assert response.status_code == status, response.get_data()
    assert response.mimetype == "application/json"
    body = strict_json(response.get_data())
    assert set(body) == {"error"} and isinstance(body["error"], str) and len(body["error"]) > 10
    return body["error"]


def with_input(**changes):
    return dict(GOOD, inputs=[dict(GOOD["inputs"][0], **changes)])


def with_parameters(**changes):
    return dict(GOOD, parameters=dict(GOOD["parameters"], **changes))


BAD_DOCUMENTS = [
    ({}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"inputs": "vectors"}, "inputs"),
    (dict(GOOD, extra=1), "extra"),
    ({"inputs": [dict(GOOD["inputs"][0], name="x")]}, "vectors"),
    ({"inputs": GOOD["inputs"] * 2}, "vectors"),
    (with_input(datatype="INT32"), "FP32"),
    (with_input(datatype="FP16"), "FP32"),
    (with_input(shape=[6]), "shape"),
    (with_input(shape=[3, 2, 1]), "shape"),
    (with_input(shape=[3, "2"]), "shape"),
    (with_input(shape=[-1, 2]), "shape"),
    (with_input(shape=[3, True]), "shape"),
    (with_input(data=[1.0, 2.0, 3.0]), "takes 6"),
    (with_input(data=[[1.0, 2.0], [3.0, 4.0]]), "shape"),
    (with_input(data=[[1.0, 2.0], [3.0, 4.0], [5.0]]), "shape"),
    (with_input(data=[1.0, 2.0, 3.0, 4.0, 5.0, "6"]), "column 1"),
    (with_input(data=[1.0, 2.0, 3.0, True, 5.0, 6.0]), "Row 1, column 1"),
    (with_input(data=[1.0, None, 3.0, 4.0, 5.0, 6.0]), "Row 0, column 1"),
    (with_input(data=[1.0, 2.0, 3.0, 4.0, 5.0, 1e39]), "overflows float32"),
    (with_input(data="1,2,3,4,5,6"), "data"),
    (with_input(data=[]), "takes 6"),
    (with_input(shape=[0, 2], data=[]), "non-empty"),
    ({"inputs": [vectors_input((3, 2))]}, "neither"),
    (with_input(parameters={"binary_data_size": 24}), "both"),
    (with_input(parameters={"scale": 2}), "scale"),
    (with_parameters(factor=0), "factor"),
    (with_parameters(factor=4), "factor"),
    (with_parameters(factor=1.5), "factor"),
    (with_parameters(factor="2"), "factor"),
    (with_parameters(factor=True), "factor"),
    (with_parameters(objective="max"), "objective"),
    (with_parameters(objective="__import__('os')"), "objective"),
    (with_parameters(offset="5"), "offset"),
    (with_parameters(offset=1e39), "offset"),
    (with_parameters(dtype="float64"), "dtype"),
    (with_parameters(binary_data_output="yes"), "binary_data_output"),
    (dict(GOOD, outputs=[]), "outputs"),
    (dict(GOOD, outputs=[{"name": "gradients"}]), "gradients"),
    (dict(GOOD, outputs=[{"name": "losses"}, {"name": "losses"}]), "twice"),
    (dict(GOOD, outputs=[{"name": "losses", "parameters": {"binary_data": "true"}}]), "binary_data"),
    (dict(GOOD, outputs=[{"name": "losses", "parameters": {"classification": 2}}]), "classification"),
    (dict(GOOD, outputs=["losses"]), "outputs"),
    (dict(GOOD, id=7), "id"),
]


@pytest.mark.parametrize("document,mentions", BAD_DOCUMENTS)
def test_bad_documents(client, document, mentions):
    message = assert_protocol_error(client.post(INFER, json=document), 400)
    assert mentions in message
    assert_still_serving(client)


@pytest.mark.parametrize("data,content_type,status", [
    (b"{", "application/json", 400),
    (b"", "application/json", 400),
    (b"null", "application/json", 400),
    (b"[1]", "application/json", 400),
    (b'{"inputs": [{"name": "vectors", "shape": [1, 1], "datatype": "FP32", "data": [NaN]}]}', "application/json", 400),
    (b'{"inputs": [{"name": "vectors", "shape": [1, 1], "datatype": "FP64", "data": [1e400]}]}', "application/json", 400),
    (json.dumps(GOOD).encode(), "text/plain", 415),
    (json.dumps(GOOD).encode(), "application/x-www-form-urlencoded", 415),
])
def test_bad_bodies(client, data, content_type, status):
    assert_protocol_error(client.post(INFER, data=data, headers={"Content-Type": content_type}), status)
    assert_still_serving(client)


def test_json_body_without_content_type_is_accepted(client):
    """Standard clients (tritonclient) send the body with no Content-Type."""
    assert_good_answer(client.post(INFER, data=json.dumps(GOOD).encode()))


def bad_binary_cases():
    good = np.ones((3, 2))
    body, headers = binary_request(good)
    length = int(headers[HEADER])
    yield "short data", body[:-4], headers, "binary_data_size"
    yield "extra data", body + b"\0\0\0\0", headers, "binary_data_size"
    yield "header length not a number", body, dict(headers, **{HEADER: "abc"}), HEADER
    yield "header length past the body", body, dict(headers, **{HEADER: str(len(body) + 1)}), HEADER
    yield "raw binary request", body[length:], dict(headers, **{HEADER: "0"}), "raw binary"
    yield "header cut short", body, dict(headers, **{HEADER: str(length - 1)}), "JSON"
    # binary_data_size agrees with the bytes sent but not with the shape
    document = {"inputs": [vectors_input((3, 3), parameters={"binary_data_size": 24})]}
    header = json.dumps(document).encode()
    yield "size not the shape's", header + bytes(24), {HEADER: str(len(header))}, "takes 36"
    document = {"inputs": [vectors_input((3, 2), parameters={"binary_data_size": "24"})]}
    header = json.dumps(document).encode()
    yield "size a string", header + bytes(24), {HEADER: str(len(header))}, "binary_data_size"
    header = json.dumps(GOOD).encode()
    yield "bytes but no binary input", header + bytes(8), {HEADER: str(len(header))}, "binary_data_size"
    for datatype, bad, cell in [("FP32", float("nan"), "Row 1, column 0"), ("FP64", float("inf"), "Row 1, column 0"),
                                ("FP64", float("-inf"), "Row 1, column 0")]:
        values = np.ones((3, 2))
        values[1, 0] = bad
        body, headers = binary_request(values, datatype)
        yield f"{datatype} {bad}", body, headers, cell


@pytest.mark.parametrize("name,body,headers,mentions", list(bad_binary_cases()),
                         ids=[case[0] for case in bad_binary_cases()])
def test_bad_binary_requests(client, name, body, headers, mentions):
    message = assert_protocol_error(client.post(INFER, data=body, headers=headers), 400)
    assert mentions in message
    assert_still_serving(client)


def test_non_finite_result_is_a_400(client):
    body, headers = binary_request(np.array([[0.0], [0.0], [3e19]]), "FP32",
                                   parameters={"factor": 3, "objective": "sum_of_squares"})
    message = assert_protocol_error(client.post(INFER, data=body, headers=headers), 400)
    assert "row 0, col 2" in message
    assert_still_serving(client)


HUGE = 2 ** 63  # past what numpy can index; orjson still reads it as an integer


def declared_shape_request(shape, binary: bool):
    """A body of a few bytes declaring `shape`, with no numbers (empty data, or 0 binary bytes)."""
    if binary:
        document = {"inputs": [vectors_input(shape, parameters={"binary_data_size": 0})]}
        header = json.dumps(document).encode()
        return {"data": header, "headers": {HEADER: str(len(header)), "Content-Type": "application/octet-stream"}}
    return {"json": {"inputs": [vectors_input(shape, data=[])]}}


@pytest.fixture
def nothing_built(monkeypatch):
    """Declared shapes are refused before any row is built or any binary data decoded."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("built rows or decoded data for a shape that should have been refused")
    monkeypatch.setattr("app.http.pipeline.to_matrix", must_not_run)
    monkeypatch.setattr("app.core.vectors.decode_tensor", must_not_run)
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("shape,status,mentions", [
    ([5_000_000, 0], 400, "non-empty rows"),
    ([0, 5_000_000], 400, "non-empty"),
    ([HUGE, 0], 400, "non-empty rows"),
    ([0, HUGE], 400, "non-empty"),
    ([0, 0], 400, "non-empty"),
    ([5_000_000, 1], 413, "BLOCKGRAD_MAX_N"),
    ([HUGE, HUGE], 413, "BLOCKGRAD_MAX_N"),
    ([1, 5_000_000], 413, "BLOCKGRAD_MAX_D"),
])
def test_declared_shape_is_checked_before_anything_is_built(client, nothing_built, binary, shape, status, mentions):
    message = assert_protocol_error(client.post(INFER, **declared_shape_request(shape, binary)), status)
    assert mentions in message


def test_huge_binary_shape_is_a_codec_error():
    """decode_tensor's own guard, should a shape numpy cannot index ever reach it."""
    from app.core.vectors import MatrixError, decode_tensor

    with pytest.raises(MatrixError, match="cannot be read"):
        decode_tensor(memoryview(b""), np.dtype("<f4"), [HUGE, 0])


@pytest.mark.parametrize("value", ["²", "\u0662\u0664", "\U0001d7d9", "1²", " ", "-1", "+5", "1e3"])
def test_header_length_must_be_ascii_digits(value):
    """str.isdigit() is true for '²' and other scripts' digits, which int() refuses or reads."""
    from app.api.v2.codec import CodecError, split_body

    with pytest.raises(CodecError, match=HEADER):
        split_body(b"{}", value)


def test_superscript_header_length_is_a_400(client):
    """'²' is byte 0xB2 in latin-1: a header an HTTP client can send, and it reaches the app as '²'."""
    body, headers = binary_request(np.ones((3, 2)))
    message = assert_protocol_error(client.post(INFER, data=body, headers=dict(headers, **{HEADER: "²"})), 400)
    assert HEADER in message
    assert_still_serving(client)


@pytest.mark.parametrize("config,document,mentions", [
    ({"BLOCKGRAD_MAX_N": 2}, GOOD, "BLOCKGRAD_MAX_N"),
    ({"BLOCKGRAD_MAX_D": 1}, GOOD, "BLOCKGRAD_MAX_D"),
    # N = 3, D = 2: factor 2 leaves a 2 x 2 x 4 = 16 block, factor 3 one of 4
    ({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 10}, with_parameters(factor=1), "BLOCKGRAD_MAX_BLOCK_ELEMENTS"),
    ({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 20}, GOOD, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
    ({"BLOCKGRAD_MAX_BODY_BYTES": 100}, GOOD, "BLOCKGRAD_MAX_BODY_BYTES"),
])
def test_limits_are_413(config, document, mentions):
    client = create_app(config).test_client()
    message = assert_protocol_error(client.post(INFER, json=document), 413)
    assert mentions in message


def test_output_limit_counts_only_asked_outputs():
    client = create_app({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 20}).test_client()  # blocks alone are 36
    response = client.post(INFER, json=dict(GOOD, outputs=[{"name": "accumulated"}, {"name": "bounds"}]))
    assert_good_answer(response, ["accumulated", "bounds"])


def test_deadline_is_503_with_retry_after():
    client = create_app({"BLOCKGRAD_REQUEST_TIMEOUT_S": 1e-9, "BLOCKGRAD_COST_PER_BLOCK_S": 1e-15,
                         "BLOCKGRAD_COST_PER_NUMBER_S": 1e-15}).test_client()  # admitted, then past the deadline
    response = client.post(INFER, json=GOOD)
    assert_protocol_error(response, 503)
    assert int(response.headers["Retry-After"]) >= 1


def test_internal_error_hides_internals(client, monkeypatch, caplog):
    def explode(*args, **kwargs):
        raise RuntimeError("secret internal detail")
    monkeypatch.setattr("app.http.pipeline.run", explode)
    message = assert_protocol_error(client.post(INFER, json=GOOD), 500)
    assert "secret" not in message and "secret internal detail" in caplog.text
    monkeypatch.undo()
    assert_still_serving(client)


def test_v1_errors_keep_their_shape(client):
    """The protocol's error body is only for /v2."""
    body = strict_json(client.get("/v2x").get_data())
    assert body["error"]["code"] == "not_found"
    body = strict_json(client.post("/v1/gradients", json={"vectors": []}).get_data())
    assert body["error"]["code"] == "validation_error"


def test_client_helpers_round_trip(client):
    """The client package's codec (client/blockgrad_client/infer.py) agrees with the struct reader above."""
    from blockgrad_client.infer import binary_infer_request, read_infer_response

    vectors = np.random.default_rng(3).standard_normal((6, 2))
    body, headers = binary_infer_request(vectors, {"factor": 2}, outputs=["losses", "block_gradients"])
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200
    header, tensors = read_infer_response(response.get_data(), response.headers)
    _, expected = read_response(response)
    assert list(tensors) == ["losses", "block_gradients"] and tensors["losses"].dtype == np.float64
    for name in tensors:
        assert np.array_equal(tensors[name], expected[name])


def test_v2_refuses_chunked_bodies_over_the_limit_and_compressed_bodies():
    limit = 512
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_BODY_BYTES": limit}).test_client()
    document = orjson.dumps({"inputs": [{"name": "vectors", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]})
    chunked = dict(path="/v2/models/blockgrad/infer", method="POST", content_type="application/json",
                   headers={"Transfer-Encoding": "chunked"}, environ_overrides={"wsgi.input_terminated": True})
    over = client.open(input_stream=io.BytesIO(document + b" " * (2 * limit)), **chunked)
    assert over.status_code == 413 and isinstance(strict_json(over.get_data())["error"], str)
    at_limit = client.open(input_stream=io.BytesIO(document + b" " * (limit - len(document))), **chunked)
    # V = [[1, 2]], one block [1, 2, 1, 2]: sum(B + 5) = 26, gradient 1, accumulated 2N = 2
    assert_good_answer(at_limit, answer={"block_gradients": np.ones((1, 1, 4)), "accumulated": [[2.0, 2.0]],
                                         "bounds": [0, 1], "losses": [[26.0]]})
    compressed = client.post("/v2/models/blockgrad/infer", data=gzip.compress(document),
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert compressed.status_code == 415 and "uncompressed" in strict_json(compressed.get_data())["error"]


@pytest.mark.parametrize("config,document,limit", [
    ({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 10}, with_parameters(factor=1), "BLOCKGRAD_MAX_BLOCK_ELEMENTS"),
    ({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 20}, GOOD, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
])
def test_limits_are_refused_before_queueing_for_the_slot(monkeypatch, config, document, limit):
    """A request over a limit is 413 at once, never after waiting behind another computation."""
    def must_not_queue(*args, **kwargs):
        raise AssertionError("a request over a limit queued for the compute slot")
    monkeypatch.setattr("app.core.slots.Gate.acquire", must_not_queue)
    client = create_app(config).test_client()
    assert limit in assert_protocol_error(client.post(INFER, json=document), 413)


def test_bounds_alone_is_not_held_to_the_block_limit():
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 10}).test_client()
    response = client.post(INFER, json=dict(with_parameters(factor=1), outputs=[{"name": "bounds"}]))
    assert_good_answer(response, ["bounds"], {"bounds": [0, 3]})


# --- block_gradients is made a block row at a time as it is written


def reference_grid(vectors: torch.Tensor, factor: int, objective: str) -> np.ndarray:
    """(N, N, 2D) from the literal per-block loop, each block's gradient put at its rows and columns."""
    n, base = len(vectors), len(vectors) // factor
    starts = [k * base for k in range(factor)] + [n]
    grid = np.zeros((n, n, 2 * vectors.shape[1]))
    blocks = iter(reference_blocks(vectors, factor, objective))
    for r in range(factor):
        for c in range(factor):
            grid[starts[r]:starts[r + 1], starts[c]:starts[c + 1]] = next(blocks)[1].numpy()
    return grid


def test_gradient_rows_are_the_grid_one_block_row_at_a_time():
    from app.api.v2.infer import gradient_rows
    from app.core.request import GradientRequest
    from app.core.run import run
    from app.core.settings import Settings

    vectors = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    req = GradientRequest(vectors=vectors.numpy(), factor=3, objective="sum_of_squares", offset=5.0,
                          outputs=("blocks",), dtype="float64")
    slabs = list(gradient_rows(run(req, Settings())))
    assert [slab.shape for slab in slabs] == [(3, 10, 6), (3, 10, 6), (4, 10, 6)]  # the last takes the rest
    np.testing.assert_array_equal(np.concatenate(slabs), reference_grid(vectors, 3, "sum_of_squares"))


@pytest.mark.parametrize("objective,recomputed", [("sum_of_squares", True), ("sum", False)])
def test_a_grid_takes_a_slot_while_written_only_to_recompute_its_blocks(objective, recomputed):
    """Dense gradients over one block's memory are recomputed as written, a band at a time,
    each band on a slot taken again (Gate.resume); kept blocks are only copied. Either way no
    slot is held while the answer waits for its reader."""
    app = create_app({"TESTING": True, "BLOCKGRAD_MAX_BLOCK_ELEMENTS": 1000})  # keeps <= 1000 numbers of gradients
    gate = app.extensions["blockgrad"].gate
    resumed, real = [], gate.resume
    gate.resume = lambda deadline: resumed.append(deadline) or real(deadline)
    vectors = torch.randn(40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    body, headers = binary_request(vectors.numpy(), "FP64", {"factor": 4, "objective": objective},
                                   [{"name": "block_gradients"}])
    response = app.test_client().post(INFER, data=body, headers=headers, buffered=False)
    assert response.status_code == 200
    assert gate.busy == 0
    _, tensors = read_response(response)
    assert gate.busy == 0
    assert bool(resumed) == recomputed
    assert list(tensors) == ["block_gradients"]
    assert_matches(tensors["block_gradients"], reference_grid(vectors, 4, objective), "float64")


def test_the_comparison_fails_a_missing_output_or_a_wrong_number(client):
    """assert_matches_reference is what the tests above rely on: it must refuse an answer with
    block_gradients dropped, outputs reordered, or one number off by 0.1%."""
    vectors = torch.randn(9, 4, dtype=torch.float64).to(torch.float32)
    body, headers = binary_request(vectors.numpy(), "FP32", parameters={"factor": 4, "binary_data_output": True})
    _, tensors = read_response(client.post(INFER, data=body, headers=headers))
    expected = reference_outputs(vectors, 4, "sum", 5.0, [0, 2, 4, 6, 9])
    assert_matches_reference(tensors, expected, "FP32", ALL_OUTPUTS)
    dropped = {name: array for name, array in tensors.items() if name != "block_gradients"}
    reordered = dict(reversed(list(tensors.items())))
    off = dict(tensors, accumulated=tensors["accumulated"] * np.float32(1.001))
    for wrong in (dropped, reordered, off):
        with pytest.raises(AssertionError):
            assert_matches_reference(wrong, expected, "FP32", ALL_OUTPUTS)
