"""The Open Inference Protocol's binary tensor data, both ways (numpy and json only).

A binary body is the JSON header followed by each binary tensor's bytes (little-endian,
row-major, in the header's order); the Inference-Header-Content-Length header gives
the JSON's length.

    body, headers = binary_infer_request(vectors, {"factor": 8})
    header, tensors = read_infer_response(answer_bytes, answer_headers)
"""
import json
from collections.abc import Mapping, Sequence

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
MODEL_NAME = "blockgrad"
INPUT_NAME = "vectors"
OUTPUTS = ("block_gradients", "accumulated", "bounds", "losses")
BINARY_DTYPES = {"FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"), "INT64": np.dtype("<i8")}
DATATYPE_OF_DTYPE = {"float32": "FP32", "float64": "FP64"}


def input_datatype(vectors: np.ndarray) -> str:
    """FP64 for float64 vectors, FP32 for anything else (the server computes in the input's datatype)."""
    return DATATYPE_OF_DTYPE.get(np.asarray(vectors).dtype.name, "FP32")


def binary_infer_request(vectors, parameters: Mapping | None = None, outputs: Sequence[str] | None = None,
                         binary_output: bool = True, datatype: str | None = None) -> tuple[bytes, dict]:
    """Body and headers: `vectors` (N, D) as binary tensor data in `datatype` (default: FP64 for
    float64 arrays, else FP32), the model's parameters (factor, objective, offset), and the
    outputs (default all), binary or JSON."""
    vectors = np.asarray(vectors)
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be 2-D (N, D), got shape {vectors.shape}")
    datatype = datatype or input_datatype(vectors)
    data = np.ascontiguousarray(vectors, dtype=BINARY_DTYPES[datatype]).tobytes()
    document = {
        "inputs": [{"name": INPUT_NAME, "shape": list(vectors.shape), "datatype": datatype,
                    "parameters": {"binary_data_size": len(data)}}],
        "parameters": {**(parameters or {}), "binary_data_output": binary_output},
        "outputs": [{"name": name} for name in (outputs or OUTPUTS)],
    }
    header = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    return header + data, {HEADER_LENGTH: str(len(header)), "Content-Type": BINARY_CONTENT_TYPE}


def read_infer_response(body: bytes, headers: Mapping) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON header and every output as an array (binary or JSON), by name, in the answer's order.
    Binary outputs are views of `body` (no copy)."""
    length = headers.get(HEADER_LENGTH)
    end = int(length) if length is not None else len(body)
    header = json.loads(body[:end])
    tensors, offset = {}, end
    for output in header["outputs"]:
        dtype = BINARY_DTYPES[output["datatype"]]
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is None:
            array = np.array(output["data"], dtype=dtype)
        else:
            if offset + size > len(body):
                raise ValueError(f"output {output['name']!r} needs {size} bytes at {offset}; "
                                 f"the body has {len(body)}")
            array = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            offset += size
        tensors[output["name"]] = array.reshape(output["shape"])
    return header, tensors
