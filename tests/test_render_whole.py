"""/v1's small answer written in one orjson call is byte for byte the document the stream
would have joined to (head, then each block with its own loss tensor)."""
import numpy as np

from app.api.v1.render import answer_head, render_result, stream_with_blocks
from app.core.request import build_request
from app.core.run import run
from app.core.settings import Settings

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
