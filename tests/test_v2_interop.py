"""A published client of the protocol (tritonclient[http]) against the real service.

gunicorn serves wsgi:app on 127.0.0.1 on a free port, started and stopped here.
The client sends binary inputs and asks for binary outputs; the numbers must be
/v1/gradients' exactly, and the seed's loops' (tests/reference.py).
"""
import numpy as np
import pytest
import requests
import torch

from tools.server import gunicorn_server
from .numeric import assert_matches
from .test_v2 import reference_outputs

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow  # one gunicorn for the module

OUTPUT_NAMES = ["block_gradients", "accumulated", "bounds", "losses"]


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=1, ready_path="/v2/health/ready") as server:
        yield f"127.0.0.1:{server.port}"


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(url=server)
    try:
        yield client
    finally:
        client.close()


def test_client_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("blockgrad")
    assert not client.is_model_ready("blockgrad", model_version="9")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata("blockgrad")
    assert metadata["inputs"] == [{"name": "vectors", "datatype": "FP32", "datatypes": ["FP32", "FP64"],
                                   "shape": [-1, -1]}]
    assert [o["name"] for o in metadata["outputs"]] == OUTPUT_NAMES


def test_binary_inputs_and_outputs_equal_v1_and_reference(client, server):
    vectors = np.random.default_rng(2).standard_normal((9, 4)).astype(np.float32)
    tensor = httpclient.InferInput("vectors", list(vectors.shape), "FP32")
    tensor.set_data_from_numpy(vectors, binary_data=True)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in OUTPUT_NAMES]
    result = client.infer("blockgrad", [tensor], outputs=outputs, request_id="r1",
                          parameters={"factor": 4, "objective": "l2_norm"})
    assert all("binary_data_size" in result.get_output(name)["parameters"] for name in OUTPUT_NAMES)
    got = {name: result.as_numpy(name) for name in OUTPUT_NAMES}
    assert [o["name"] for o in result.get_response()["outputs"]] == OUTPUT_NAMES
    assert result.get_response()["id"] == "r1"

    v1 = requests.post(f"http://{server}/v1/gradients", timeout=60, json={
        "vectors": vectors.tolist(), "factor": 4, "objective": "l2_norm",
        "outputs": ["blocks", "accumulated", "losses"]}).json()
    assert got["bounds"].tolist() == v1["bounds"] == [0, 2, 4, 6, 9]
    # Chunks on the pod's free slots sum accumulated in another order (docs/cores.md): the tolerance.
    assert_matches(got["accumulated"], np.array(v1["accumulated"], dtype=np.float32), "float32", what="accumulated")
    assert np.array_equal(got["losses"], np.array(v1["losses"], dtype=np.float32))
    for block in v1["blocks"]:
        (r0, r1), (c0, c1) = block["rows"], block["cols"]
        assert np.array_equal(got["block_gradients"][r0:r1, c0:c1], np.array(block["gradient"], dtype=np.float32))

    expected = reference_outputs(torch.from_numpy(vectors), 4, "l2_norm", 5.0, v1["bounds"])
    for name in ["block_gradients", "accumulated", "losses"]:
        assert_matches(got[name], expected[name], "float32", what=name)


def test_default_outputs_fp64_and_json_input(client):
    """No outputs listed: the client asks for all as binary (binary_data_output)."""
    vectors = np.linspace(-1, 1, 15).reshape(5, 3)
    tensor = httpclient.InferInput("vectors", [5, 3], "FP64")
    tensor.set_data_from_numpy(vectors, binary_data=False)  # JSON data this time
    result = client.infer("blockgrad", [tensor], parameters={"objective": "sum_of_squares", "factor": 2})
    expected = reference_outputs(torch.from_numpy(vectors), 2, "sum_of_squares", 5.0, [0, 2, 5])
    assert [o["name"] for o in result.get_response()["outputs"]] == OUTPUT_NAMES
    for name in ["block_gradients", "accumulated", "losses"]:
        array = result.as_numpy(name)
        assert array.dtype == np.float64
        assert_matches(array, expected[name], "float64", what=name)
    assert result.as_numpy("bounds").tolist() == [0, 2, 5]


def test_errors_reach_the_client(client):
    tensor = httpclient.InferInput("vectors", [2, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 2), dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("blockgrad", [tensor], parameters={"factor": 3})
    assert raised.value.status() == "400" and "factor" in raised.value.message()
    with pytest.raises(InferenceServerException) as raised:
        client.infer("other", [tensor])
    assert raised.value.status() == "404"
    assert client.infer("blockgrad", [tensor]).as_numpy("bounds").tolist() == [0, 2]


def test_streamed_json_outputs_reach_the_client(client, server):
    """JSON outputs come back streamed (chunked transfer, no Content-Length); the client reads them whole."""
    raw = requests.post(f"http://{server}/v2/models/blockgrad/infer", timeout=60, json={
        "inputs": [{"name": "vectors", "shape": [2, 1], "datatype": "FP32", "data": [1.0, 2.0]}]})
    assert raw.status_code == 200 and raw.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in raw.headers and raw.json()["outputs"][2]["data"] == [0, 2]
    vectors = np.random.default_rng(6).standard_normal((40, 16))
    tensor = httpclient.InferInput("vectors", list(vectors.shape), "FP64")
    tensor.set_data_from_numpy(vectors, binary_data=True)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=False) for name in OUTPUT_NAMES]
    result = client.infer("blockgrad", [tensor], outputs=outputs, parameters={"factor": 3})
    assert all("data" in result.get_output(name) for name in OUTPUT_NAMES)
    expected = reference_outputs(torch.from_numpy(vectors), 3, "sum", 5.0, [0, 13, 26, 40])
    assert [o["name"] for o in result.get_response()["outputs"]] == OUTPUT_NAMES
    for name in ["block_gradients", "accumulated", "losses"]:
        assert_matches(result.as_numpy(name), expected[name], "float64", what=name)
    assert result.as_numpy("bounds").tolist() == [0, 13, 26, 40]
