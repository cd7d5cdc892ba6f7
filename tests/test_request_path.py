"""The fast request path (issue 5): kept vs recomputed blocks, the cheap finiteness
proof, chunked streaming, and the big accumulated-only request's admission."""
import json

import numpy as np
import pytest
import torch

from app import create_app
from app.api.v1.gradients import stream_with_blocks
from app.core import run as executor
from app.core.engine import band_blocks, chunk_gradients, plan_bands
from app.core.admission import check_block_and_answer
from app.core.request import GradientRequest, Sizes
from app.core.errors import BlockgradError
from app.core.objectives import OBJECTIVES
import app.core.run as compute
from app.core.run import Deadline, load_vectors, pass_one
from app.core.settings import Settings
from app.http.sending import to_numpy

from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches



def make_request(vectors, **kwargs):
    fields = dict(factor=3, objective="sum_of_squares", offset=5.0, outputs=("blocks", "accumulated"),
                  dtype="float32")
    fields.update(kwargs)
    return GradientRequest(vectors=np.asarray(vectors, dtype=np.float64), **fields)


def run_summary(req, keep_bytes=0):
    cpu = torch.device("cpu")
    return pass_one(req, cpu, load_vectors(req, cpu), Deadline(60), keep_bytes=keep_bytes)


def test_kept_blocks_match_the_seed_loops():
    vectors = np.random.default_rng(1).standard_normal((11, 3))
    req = make_request(vectors)
    summary = run_summary(req, keep_bytes=11 * 11 * 6 * 4)  # dense float32 gradients, exactly
    expected = reference_blocks(torch.as_tensor(vectors, dtype=torch.float32), 3, "sum_of_squares")
    assert summary.kept is not None and len(summary.kept) == 9
    for block, (loss, grad) in zip(summary.kept, expected, strict=True):
        assert_matches(block.loss, loss, "float32")
        assert_matches(block.gradient, grad, "float32")
    assert_matches(summary.accumulated,
                   reference_accumulated(torch.as_tensor(vectors, dtype=torch.float32), 3, "sum_of_squares"),
                   "float32")


@pytest.mark.parametrize("keep_bytes,outputs", [
    (11 * 11 * 6 * 4 - 1, ("blocks", "accumulated")),  # one byte short
    (0, ("blocks",)),
    (10 ** 9, ("accumulated", "losses")),  # blocks not asked for: nothing to keep
])
def test_blocks_are_not_kept_past_the_budget_or_when_not_asked(keep_bytes, outputs):
    req = make_request(np.ones((11, 3)), outputs=outputs)
    assert run_summary(req, keep_bytes).kept is None


def test_sum_gradients_are_kept_at_the_cost_of_one_number_each():
    # sum's gradient is a view of one number: 9 blocks cost 9 x 4 bytes, not 11 x 11 x 6 x 4.
    req = make_request(np.ones((11, 3)), objective="sum")
    summary = run_summary(req, keep_bytes=9 * 4)
    assert summary.kept is not None and all(bool((b.gradient == 1).all()) for b in summary.kept)


def test_finiteness_recheck_skips_blocks_that_are_finite(monkeypatch):
    vectors = np.zeros((4, 2))
    vectors[3, 0] = 1e20  # squares overflow float32 in every block holding V[3]: (0, 1), (1, 0), (1, 1)
    req = make_request(vectors, factor=2)
    computed = executor.PassOne(executor.SerialExecutor(), load_vectors(req, torch.device("cpu")), 2, 1,
                                req.objective_fn, req.offset)  # one block a chunk
    list(computed)
    recomputed, real = [], executor.chunk_gradients

    def counted(vectors, chunk, *rest):
        recomputed.append((chunk.rows.start, chunk.cols.start))
        return real(vectors, chunk, *rest)
    monkeypatch.setattr(executor, "chunk_gradients", counted)
    assert not computed.surely_finite()
    assert computed.first_non_finite_block() == (0, 1)
    assert recomputed == [(0, 1), (1, 0), (1, 1)]  # (0, 0): its losses and sums prove it finite


@pytest.mark.parametrize("chunk_bytes", [1, 200, 10 ** 9])
def test_stream_is_one_json_document_whatever_the_chunking(monkeypatch, chunk_bytes):
    monkeypatch.setattr("app.api.v1.gradients.CHUNK_BYTES", chunk_bytes)
    vectors = torch.randn(7, 2)
    blocks = [block for band in plan_bands(7, 2, 3, 1024 * 1024)
              for block in band_blocks([chunk_gradients(vectors, chunk, OBJECTIVES["logsumexp"], 5.0) for chunk in band])]
    head = {"n": 7, "accumulated": to_numpy(torch.zeros(7, 2))}
    chunks = list(stream_with_blocks(head, iter(blocks)))
    body = json.loads(b"".join(chunks))
    assert list(body) == ["n", "accumulated", "blocks"]
    assert body["accumulated"] == [[0.0, 0.0]] * 7
    expected = reference_blocks(vectors, 3, "logsumexp")
    assert [(b["row"], b["col"]) for b in body["blocks"]] == [(r, c) for r in range(3) for c in range(3)]
    for block, (loss, grad) in zip(body["blocks"], expected, strict=True):
        assert_matches(block["gradient"], grad, "float32")
        assert_matches(block["loss"], loss, "float32")
    if chunk_bytes == 1:
        assert len(chunks) > 9  # streamed, not built whole


def test_kept_and_recomputed_answers_are_the_same_bytes(monkeypatch):
    body = {"vectors": np.random.default_rng(2).standard_normal((11, 3)).tolist(), "factor": 3,
            "objective": "l2_norm", "outputs": ["blocks", "accumulated", "losses"]}
    real, kept_by_pass_one, keep_nothing = compute.pass_one, [], []

    def summarize(req, device, vectors, deadline, keep_bytes, *rest):
        result = real(req, device, vectors, deadline, 0 if keep_nothing else keep_bytes, *rest)
        kept_by_pass_one.append(result.kept is not None)
        return result
    monkeypatch.setattr(compute, "pass_one", summarize)
    kept = create_app().test_client().post("/v1/gradients", json=body)
    # The same limits (so the same chunks and the same order of additions in the accumulated
    # gradient), but nothing may be kept: pass two recomputes.
    keep_nothing.append(True)
    recomputed = create_app().test_client().post("/v1/gradients", json=body)
    assert kept_by_pass_one == [True, False]
    assert kept.status_code == recomputed.status_code == 200
    assert kept.get_data() == recomputed.get_data()
    blocks = json.loads(recomputed.get_data())["blocks"]
    expected = reference_blocks(torch.tensor(body["vectors"], dtype=torch.float32), 3, "l2_norm")
    for block, (loss, grad) in zip(blocks, expected, strict=True):
        assert_matches(block["gradient"], grad, "float32")
        assert_matches(block["loss"], loss, "float32")


def test_big_accumulated_only_request_is_admitted_by_default():
    """N = 4096, D = 64, F = 64 with outputs ["accumulated"] passes the default limits, though
    the same shape asking for its blocks (4096 * 4096 * 128 numbers) is over them: only the
    outputs asked for are counted."""
    settings = Settings()
    assert check_block_and_answer(Sizes(4096, 64, 64, ("accumulated",)), settings) is None
    with pytest.raises(BlockgradError) as refused:
        check_block_and_answer(Sizes(4096, 64, 64, ("blocks", "accumulated")), settings)
    assert refused.value.code == "limit_exceeded"
    assert refused.value.details["limit"] == "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"
    assert refused.value.details["value"] == 4096 * 4096 * 128 + 4096 * 64
