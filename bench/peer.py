"""The small-requests row's reference peer: a minimal Flask app doing /v1/gradients' default
computation (objective sum, offset 5, float32, outputs blocks and accumulated) the way a
hand-written service would, with no validation, limits, streaming, logging or metrics.

Served by gunicorn's sync worker (bench/peer_gunicorn.py); the row compares the service with it.
"""
import math

import flask
import torch

OFFSET = 5.0  # the service's default offset for the sum objective

app = flask.Flask(__name__)


def block_bounds(n: int, factor: int) -> list[int]:
    """The seed's split: blocks of n // factor rows, the last one taking the remainder."""
    base = n // factor
    return [k * base for k in range(factor)] + [n]


def pair_matrix(vectors: torch.Tensor) -> torch.Tensor:
    """(N, N, 2D): entry [i, j] is (v_j, v_i), as the seed's concat_matrix builds it."""
    n, dim = vectors.shape
    return torch.cat((vectors.unsqueeze(0).expand(n, n, dim), vectors.unsqueeze(1).expand(n, n, dim)), dim=-1)


@app.get("/healthz")
def healthz():
    return flask.jsonify(status="ok")


@app.post("/v1/gradients")
def gradients():
    body = flask.request.get_json()
    vectors = torch.tensor(body["vectors"], requires_grad=True)  # (N, D) float32
    n, dim = vectors.shape
    factor = body.get("factor", math.ceil(n / 6))
    bounds = block_bounds(n, factor)
    pairs = pair_matrix(vectors)
    spans = [(r, c) for r in range(factor) for c in range(factor)]  # row-block-major
    blocks = []
    for r, c in spans:  # each block its own leaf: its gradient alone
        block = pairs[bounds[r]:bounds[r + 1], bounds[c]:bounds[c + 1]].detach().requires_grad_(True)
        loss = torch.sum(block + OFFSET)
        loss.backward()
        blocks.append({"row": r, "col": c, "rows": [bounds[r], bounds[r + 1]], "cols": [bounds[c], bounds[c + 1]],
                       "loss": loss.item(), "gradient": block.grad.tolist()})
    for r, c in spans:  # one shared graph: every block's gradient summed onto the vectors
        torch.sum(pairs[bounds[r]:bounds[r + 1], bounds[c]:bounds[c + 1]] + OFFSET).backward(retain_graph=True)
    return flask.jsonify(n=n, dim=dim, factor=factor, bounds=bounds, objective="sum", dtype="float32",
                         device="cpu", accumulated=vectors.grad.tolist(), blocks=blocks)
