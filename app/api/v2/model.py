"""The one model this server speaks for, and its tensors in protocol terms (/v2's and gRPC's)."""
import numpy as np

from ...http.errors import model_not_found

MODEL_NAME = "blockgrad"
MODEL_VERSION = "1"
PLATFORM = "pytorch"
EXTENSIONS = ("binary_tensor_data",)

INPUT_NAME = "vectors"
# Protocol datatype -> (little-endian numpy dtype of its binary form, the /v1 dtype name).
FLOAT_DATATYPES = {"FP32": (np.dtype("<f4"), "float32"), "FP64": (np.dtype("<f8"), "float64")}
DATATYPE_OF_DTYPE = {dtype: name for name, (_, dtype) in FLOAT_DATATYPES.items()}
DEFAULT_DATATYPE = "FP32"

# Output name -> the /v1 output it needs computed (None: always known, costs nothing).
OUTPUTS = {"block_gradients": "blocks", "accumulated": "accumulated", "bounds": None, "losses": "losses"}

# Request parameters that are the /v1 fields of the same name, with its defaults and rules.
GRADIENT_PARAMETERS = ("factor", "objective", "offset")


def model_metadata() -> dict:
    """-1 marks a variable dimension: N vectors of length D, F blocks a side.

    The protocol gives each tensor one `datatype`: the default, FP32. `datatypes` (an
    addition clients may ignore) lists every one the input takes; the float outputs
    take the input's.
    """
    def floats(name: str, shape: list[int]) -> dict:
        return {"name": name, "datatype": DEFAULT_DATATYPE, "datatypes": list(FLOAT_DATATYPES), "shape": shape}

    return {
        "name": MODEL_NAME,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [floats(INPUT_NAME, [-1, -1])],
        "outputs": [
            floats("block_gradients", [-1, -1, -1]),  # (N, N, 2D)
            floats("accumulated", [-1, -1]),  # (N, D)
            {"name": "bounds", "datatype": "INT64", "datatypes": ["INT64"], "shape": [-1]},  # (F + 1,)
            floats("losses", [-1, -1]),  # (F, F)
        ],
    }


def check_model(model: str, version: str | None) -> None:
    if model != MODEL_NAME:
        raise model_not_found(f"Unknown model {model!r}; this server serves {MODEL_NAME!r}.")
    if version is not None and version != MODEL_VERSION:
        raise model_not_found(f"Model {MODEL_NAME!r} has no version {version!r}; it has [{MODEL_VERSION!r}].")
