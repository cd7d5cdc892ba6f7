"""Build a binary infer request and read a binary response: for the benchmark and for callers
without a protocol client. Pure module (numpy and orjson only).

    body, headers = binary_infer_request(vectors, {"factor": 8})
    response = requests.post(f"{base}/v2/models/blockgrad/infer", data=body, headers=headers)
    header, tensors = read_infer_response(response.content, response.headers)
"""
from collections.abc import Mapping

import numpy as np
import orjson

from app.api.v2.codec import BINARY_CONTENT_TYPE, HEADER_LENGTH
from app.api.v2.model import DATATYPE_OF_DTYPE, INPUT_NAME, OUTPUTS

BINARY_DTYPES = {"FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"), "INT64": np.dtype("<i8")}


def binary_infer_request(vectors: np.ndarray, parameters: Mapping | None = None,
                         outputs: list[str] | None = None, binary_output: bool = True) -> tuple[bytes, dict]:
    """Body and headers: `vectors` (N, D) float32 or float64 as binary tensor data, the
    model's parameters (factor, objective, offset), and the outputs (default all), binary or JSON."""
    datatype = DATATYPE_OF_DTYPE[np.dtype(vectors.dtype).name]
    data = np.ascontiguousarray(vectors, dtype=BINARY_DTYPES[datatype]).tobytes()
    document = {
        "inputs": [{"name": INPUT_NAME, "shape": list(vectors.shape), "datatype": datatype,
                    "parameters": {"binary_data_size": len(data)}}],
        "parameters": {**(parameters or {}), "binary_data_output": binary_output},
        "outputs": [{"name": name} for name in (outputs or OUTPUTS)],
    }
    header = orjson.dumps(document)
    return header + data, {HEADER_LENGTH: str(len(header)), "Content-Type": BINARY_CONTENT_TYPE}


def read_infer_response(body: bytes, headers: Mapping) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON header and every output as an array (binary or JSON), by name."""
    length = headers.get(HEADER_LENGTH)
    end = int(length) if length is not None else len(body)
    header = orjson.loads(body[:end])
    tensors, offset = {}, end
    for output in header["outputs"]:
        dtype = BINARY_DTYPES[output["datatype"]]
        size = output.get("parameters", {}).get("binary_data_size")
        if size is None:
            array = np.array(output["data"], dtype=dtype)
        else:
            array = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            offset += size
        tensors[output["name"]] = array.reshape(output["shape"])
    return header, tensors
