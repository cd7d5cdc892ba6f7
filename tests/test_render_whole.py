"""/v1's small answer written in one orjson call is byte for byte the document the stream
would have joined to (head, then each block with its own loss tensor)."""
import numpy as np
import orjson
import pytest
import torch

from app.api.v1.gradients import answer_head, render_result, stream_with_blocks
from app.core.request import build_request
from app.core.run import run
from app.core.settings import Settings
from app.http.sending import json_array

V = np.array([[0.5, -1.0, 3.0], [2.0, 0.25, -0.125], [1.5, 3.0, 7.0], [1e-3, -2.5, 0.1], [4.0, 0.0, -1.0]])


def test_the_whole_answer_is_the_streamed_answer_joined():
    settings = Settings(device="cpu")
    for objective, dtype, outputs, factor in [("sum", "float32", ("blocks", "accumulated"), 2),
                                              ("logsumexp", "float64", ("blocks", "accumulated", "losses"), 3),
                                              ("l2_norm", "float32", ("blocks", "losses"), 5)]:
        req = build_request(V, factor=factor, objective=objective, outputs=outputs, dtype=dtype)
        result = run(req, settings)
        assert result.kept is not None
        whole = render_result(result)
        assert isinstance(whole, bytes)
        streamed = b"".join(stream_with_blocks(answer_head(result), iter(result.kept)))
        assert whole == streamed
        assert whole.count(b'"gradient"') == factor * factor


@pytest.mark.parametrize("tensor", [
    torch.tensor(1.0).expand(5, 5, 10),  # the gradient of sum
    torch.tensor(1 / 3, dtype=torch.float64).expand(2, 3, 4),
    torch.tensor(-0.0).expand(1, 1, 3),
    torch.tensor(3.4028235e38).expand(2, 1, 2),
    torch.tensor(1e-45).expand(3, 2, 2),  # the smallest float32 subnormal
    torch.tensor(0.1).expand(1, 1, 1),
    torch.arange(6.0).reshape(2, 3),  # not broadcast: the array itself
    torch.ones(3, 1).expand(3, 4),  # broadcast along one dimension only
])
def test_a_gradient_is_written_as_orjson_writes_its_array(tensor):
    # The expected bytes: orjson's own, of the materialised array.
    expected = orjson.dumps({"gradient": tensor.contiguous().numpy()}, option=orjson.OPT_SERIALIZE_NUMPY)
    assert orjson.dumps({"gradient": json_array(tensor)}, option=orjson.OPT_SERIALIZE_NUMPY) == expected


@pytest.mark.parametrize("objective", ["sum", "mean"])
def test_broadcast_gradients_render_as_the_materialised_arrays(objective):
    """sum and mean hand back every block's gradient as one number broadcast: the answer is
    the one orjson writes from the materialised arrays."""
    req = build_request(V, factor=2, objective=objective)
    result = run(req, Settings(device="cpu"))
    assert all(not any(block.gradient.stride()) for block in result.kept)  # the case under test
    numpy = orjson.OPT_SERIALIZE_NUMPY
    head = answer_head(result)
    expected = orjson.dumps(dict(head, blocks=[{
        "row": b.r, "col": b.c, "rows": b.row_span, "cols": b.col_span,
        "loss": b.loss.numpy()[()], "gradient": b.gradient.contiguous().numpy()} for b in result.kept]), option=numpy)
    assert render_result(result) == expected
    assert b"".join(stream_with_blocks(head, iter(result.kept))) == expected
