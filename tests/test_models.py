"""Objectives loaded from BLOCKGRAD_MODEL_DIR (issue 12).

Small models are exported here (torch.export) into temporary directories. Their
answers through /v1 and /v2 are compared with tools/reference.py's literal loops
applied to the original (not exported) modules; every refusal, at start-up and
per request, is checked by its code and by what its message names.
"""
import os
import shutil

import numpy as np
import pytest
import torch
from torch.export import Dim

from app import create_app
from app.core.models import ModelError, ModelObjective
from tools.reference import reference_model_accumulated, reference_model_blocks
from tools.server import gunicorn_server

from .numeric import assert_matches, largest

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
DATATYPES = {"float32": "FP32", "float64": "FP64"}
INFER = "/v2/models/blockgrad/infer"


class Bilinear(torch.nn.Module):
    """score(v_i, v_j) = softplus(v_i W v_j) + 0.1 |v_i - v_j|^2, one number per pair: (P,)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.weight = torch.nn.Parameter(torch.randn(dim, dim))

    def forward(self, pairs):  # (P, 2D)
        left, right = pairs[:, :self.dim], pairs[:, self.dim:]  # (P, D) each
        inner = ((left @ self.weight) * right).sum(-1)  # (P,)
        return torch.nn.functional.softplus(inner) + 0.1 * ((left - right) ** 2).sum(-1)


class CentredAcrossBatch(torch.nn.Module):
    """Mixes pairs: each score minus the batch's mean score."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = torch.nn.Linear(2 * dim, 1)

    def forward(self, pairs):
        scores = self.linear(pairs).squeeze(-1)  # (P,)
        return scores - scores.mean()


class TwoScores(torch.nn.Module):
    def forward(self, pairs):
        return pairs[:, :2] * 2.0  # (P, 2): not one score per pair


class NotFinite(torch.nn.Module):
    def forward(self, pairs):
        return torch.log(-(pairs ** 2).sum(-1) - 1.0)  # log of a negative number: NaN


def export(module: torch.nn.Module, path, dim: int, dtype=torch.float32, dynamic: bool = True) -> None:
    module = module.to(dtype).eval()
    example = torch.randn(5, 2 * dim, dtype=dtype)
    shapes = ({0: Dim("pairs")},) if dynamic else None
    torch.export.save(torch.export.export(module, (example,), dynamic_shapes=shapes), str(path))


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """Every model once, exported (slow-ish), with the original modules for the reference."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("library")
    originals = {
        "pairmlp": (torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                    3, "float32"),  # (P, 1) scores
        "bilinear": (Bilinear(2), 2, "float64"),  # (P,) scores
    }
    for name, (module, dim, dtype) in originals.items():
        export(module, root / f"{name}.pt2", dim, TORCH_DTYPES[dtype])
        module.to(TORCH_DTYPES[dtype])
    export(CentredAcrossBatch(2), root / "mixing.pt2", 2)
    export(TwoScores(), root / "twoscores.pt2", 2)
    export(NotFinite(), root / "notfinite.pt2", 2)
    export(torch.nn.Linear(4, 1), root / "fixed.pt2", 2, dynamic=False)
    (root / "broken.pt2").write_bytes(b"this is not a zip archive of an exported program")
    return root, originals


def model_dir(tmp_path, library, *names, rename: dict | None = None):
    """A fresh directory holding copies of the library's files (optionally under other names)."""
    root, _ = library
    directory = tmp_path / "models"
    directory.mkdir()
    for name in names:
        target = (rename or {}).get(name, name)
        shutil.copy(root / f"{name}.pt2", directory / f"{target}.pt2")
    return directory


@pytest.fixture(scope="module")
def models_client(tmp_path_factory, library):
    """One app for the module's read-only requests (loading the models is most of a test's time)."""
    directory = model_dir(tmp_path_factory.mktemp("models"), library, "pairmlp", "bilinear")
    return create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory)}).test_client()


def reference(library, name, vectors: torch.Tensor, factor: int):
    module, _, _ = library[1][name]
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return reference_model_blocks(vectors, factor, module), reference_model_accumulated(vectors, factor, module)


def random_vectors(n: int, dim: int, dtype: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n * 100 + dim)
    return torch.randn(n, dim, generator=generator, dtype=torch.float64).to(TORCH_DTYPES[dtype])


CASES = [(7, 3), (5, 1), (4, 4), (9, 2)]  # N % F != 0, F = 1, F = N, N % F != 0 with F = 2


@pytest.mark.parametrize("name", ["pairmlp", "bilinear"])
@pytest.mark.parametrize("n, factor", CASES)
def test_v1_matches_the_literal_per_block_reference(models_client, library, name, n, factor):
    _, dim, dtype = library[1][name]
    vectors = random_vectors(n, dim, dtype)
    response = models_client.post("/v1/gradients", json={
        "vectors": vectors.tolist(), "factor": factor, "objective": name, "dtype": dtype,
        "outputs": ["blocks", "accumulated", "losses"]})
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    assert (body["objective"], body["dtype"], body["factor"]) == (name, dtype, factor)
    blocks, accumulated = reference(library, name, vectors, factor)
    assert {"blocks", "accumulated", "losses"} <= set(body)
    assert len(body["blocks"]) == factor * factor == len(blocks)
    assert np.array(body["losses"]).shape == (factor, factor)
    for k, (got, (loss, grad)) in enumerate(zip(body["blocks"], blocks, strict=True)):
        assert (got["row"], got["col"]) == divmod(k, factor)
        # A model's gradient entries are sums that cancel: held to the size of the block's gradient.
        assert_matches(got["gradient"], grad, dtype, scale=largest(grad), what=f"block {k} gradient")
        assert_matches(got["loss"], loss, dtype, what=f"block {k} loss")
        assert body["losses"][k // factor][k % factor] == got["loss"]
    assert_matches(body["accumulated"], accumulated, dtype, scale=largest(accumulated), what="accumulated")


@pytest.mark.parametrize("name", ["pairmlp", "bilinear"])
@pytest.mark.parametrize("n, factor", CASES)
def test_v2_matches_the_literal_per_block_reference(models_client, library, name, n, factor):
    _, dim, dtype = library[1][name]
    vectors = random_vectors(n, dim, dtype)
    response = models_client.post(INFER, json={
        "inputs": [{"name": "vectors", "shape": [n, dim], "datatype": DATATYPES[dtype],
                    "data": vectors.flatten().tolist()}],
        "parameters": {"factor": factor, "objective": name}})
    assert response.status_code == 200, response.get_data(as_text=True)
    body = response.get_json()
    assert body["parameters"]["objective"] == name
    outputs = {o["name"]: torch.tensor(o["data"], dtype=torch.float64).reshape(o["shape"]) for o in body["outputs"]}
    blocks, accumulated = reference(library, name, vectors, factor)
    bounds = [int(b) for b in outputs["bounds"].tolist()]
    assert [o["name"] for o in body["outputs"]] == ["block_gradients", "accumulated", "bounds", "losses"]
    assert len(blocks) == factor * factor and len(bounds) == factor + 1 and bounds[-1] == n
    assert outputs["losses"].shape == (factor, factor)
    for k, (loss, grad) in enumerate(blocks):
        r, c = divmod(k, factor)
        got = outputs["block_gradients"][bounds[r]:bounds[r + 1], bounds[c]:bounds[c + 1]]
        assert_matches(got, grad, dtype, scale=largest(grad), what=f"block {k} gradient")
        assert_matches(outputs["losses"][r, c], loss, dtype, what=f"block {k} loss")
    assert_matches(outputs["accumulated"], accumulated, dtype, scale=largest(accumulated), what="accumulated")


def test_losses_of_stacked_blocks_are_each_blocks_own(models_client, library):
    """The batched interface: losses((k, h, w, 2D)) is each block's loss alone, and differentiable."""
    objective = models_client.application.extensions["blockgrad"].objectives["pairmlp"]
    assert isinstance(objective, ModelObjective)
    blocks = torch.randn(3, 2, 4, 6, generator=torch.Generator().manual_seed(3))  # (k, h, w, 2D)
    leaf = blocks.clone().requires_grad_(True)
    stacked = objective.losses(leaf, 0.0)  # (k,)
    (grad,) = torch.autograd.grad(stacked.sum(), leaf)
    module = library[1]["pairmlp"][0]
    for k in range(3):
        alone = blocks[k].clone().requires_grad_(True)
        loss = module(alone.reshape(8, 6)).sum()
        (alone_grad,) = torch.autograd.grad(loss, alone)
        assert_matches(stacked[k], loss, "float32", what=f"block {k} loss")
        assert_matches(grad[k], alone_grad, "float32", scale=largest(alone_grad), what=f"block {k} gradient")


def test_objectives_are_listed_with_file_size_and_parameters(models_client, library):
    root, originals = library
    listed = {o["name"]: o for o in models_client.get("/v1/objectives").get_json()["objectives"]}
    assert [n for n, o in listed.items() if o["kind"] == "builtin"] == [
        "sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"]
    assert listed["sum"]["dim"] is None and listed["sum"]["dtypes"] == ["float32", "float64"]
    for name in ("pairmlp", "bilinear"):
        module, dim, dtype = originals[name]
        entry = listed[name]
        assert (entry["kind"], entry["dim"], entry["dtypes"], entry["file"]) == ("model", dim, [dtype], f"{name}.pt2")
        assert entry["size_bytes"] == os.path.getsize(root / f"{name}.pt2")
        assert entry["parameters"] == sum(p.numel() for p in module.parameters())
        assert entry["bytes_per_pair"] > 0 and f"{name}.pt2" in entry["description"]
    spec = models_client.get("/openapi.json").get_json()
    assert "pairmlp" in spec["components"]["schemas"]["GradientRequest"]["properties"]["objective"]["enum"]
    assert "| `bilinear` | model | 2 | float64 |" in spec["info"]["description"]


def test_without_a_model_directory_only_the_builtins(client):
    names = [o["name"] for o in client.get("/v1/objectives").get_json()["objectives"]]
    assert names == ["sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"]


# Refusals of requests that do not fit a model.

def test_wrong_length_is_refused_naming_the_models_dim(models_client):
    response = models_client.post("/v1/gradients", json={"vectors": [[1.0, 2.0], [3.0, 4.0]], "objective": "pairmlp"})
    assert response.status_code == 422
    error = response.get_json()["error"]
    assert error["code"] == "validation_error"
    assert "D = 3" in error["details"]["fields"]["vectors"][0]
    response = models_client.post(INFER, json={"inputs": [{"name": "vectors", "shape": [2, 2], "datatype": "FP32",
                                                     "data": [1, 2, 3, 4]}], "parameters": {"objective": "pairmlp"}})
    assert response.status_code == 400 and "D = 3" in response.get_json()["error"]


def test_wrong_dtype_is_refused_naming_the_models_dtype(models_client):
    response = models_client.post("/v1/gradients", json={"vectors": [[1.0, 2.0]], "objective": "bilinear"})  # float32
    assert response.status_code == 422
    assert "float64" in response.get_json()["error"]["details"]["fields"]["dtype"][0]
    response = models_client.post(INFER, json={"inputs": [{"name": "vectors", "shape": [1, 3], "datatype": "FP64",
                                                     "data": [1, 2, 3]}], "parameters": {"objective": "pairmlp"}})
    assert response.status_code == 400
    assert "float32" in response.get_json()["error"] and "datatype" in response.get_json()["error"]


def test_unknown_objective_is_refused_listing_the_available_ones(models_client):
    response = models_client.post("/v1/gradients", json={"vectors": [[1.0, 2.0]], "objective": "nope"})
    assert response.status_code == 422
    message = response.get_json()["error"]["details"]["fields"]["objective"][0]
    assert all(name in message for name in ("sum", "logsumexp", "pairmlp", "bilinear"))
    response = models_client.post(INFER, json={"inputs": [{"name": "vectors", "shape": [1, 2], "datatype": "FP32",
                                                     "data": [1, 2]}], "parameters": {"objective": "nope"}})
    assert response.status_code == 400 and "bilinear" in response.get_json()["error"]


def test_a_block_whose_activations_are_over_the_budget_is_refused(tmp_path, library, monkeypatch):
    """At once: the refusal never queues for the compute slot."""
    def must_not_queue(*args, **kwargs):
        raise AssertionError("a request over a limit queued for the compute slot")
    monkeypatch.setattr("app.core.slots.Gate.acquire", must_not_queue)
    directory = model_dir(tmp_path, library, "pairmlp")
    app = create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory), "BLOCKGRAD_MAX_ACTIVATION_BYTES": "1"})
    response = app.test_client().post("/v1/gradients", json={"vectors": [[1.0, 2.0, 3.0]] * 4, "objective": "pairmlp",
                                                             "factor": 4})
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert error["code"] == "limit_exceeded" and error["details"]["limit"] == "BLOCKGRAD_MAX_ACTIVATION_BYTES"
    per_pair = app.extensions["blockgrad"].objectives["pairmlp"].bytes_per_pair
    assert error["details"]["value"] == 1 * 1 * per_pair


def test_the_activation_budget_names_the_smallest_factor_that_fits(tmp_path, library):
    directory = model_dir(tmp_path, library, "pairmlp")
    probe = create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory)})
    per_pair = probe.extensions["blockgrad"].objectives["pairmlp"].bytes_per_pair
    budget = 4 * 4 * per_pair  # blocks of 4 x 4 pairs fit, 8 x 8 do not
    app = create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory),
                      "BLOCKGRAD_MAX_ACTIVATION_BYTES": str(budget)})
    client = app.test_client()
    vectors = random_vectors(16, 3, "float32").tolist()
    response = client.post("/v1/gradients", json={"vectors": vectors, "objective": "pairmlp", "factor": 2})
    assert response.status_code == 413 and "factor 4 fits" in response.get_json()["error"]["message"]
    response = client.post("/v1/gradients", json={"vectors": vectors, "objective": "pairmlp", "factor": 4})
    assert response.status_code == 200


# Refusals at start-up: the file is named, and so is what failed.

@pytest.mark.parametrize("name, failure", [
    ("mixing", "does not treat pairs independently"),
    ("broken", "cannot be loaded as an exported program"),
    ("fixed", "number of pairs is fixed"),
    ("twoscores", "one score per pair"),
    ("notfinite", "not finite"),
])
def test_a_model_that_fails_a_check_stops_the_app(tmp_path, library, name, failure):
    directory = model_dir(tmp_path, library, "pairmlp", name)
    with pytest.raises(ModelError, match=failure) as info:
        create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory)})
    assert f"{name}.pt2" in str(info.value)


@pytest.mark.parametrize("stem, failure", [("sum", "built-in"), ("two words", "letters, digits")])
def test_a_bad_name_stops_the_app(tmp_path, library, stem, failure):
    directory = model_dir(tmp_path, library, "pairmlp", rename={"pairmlp": stem})
    with pytest.raises(ModelError, match=failure) as info:
        create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(directory)})
    assert f"{stem}.pt2" in str(info.value)


def test_a_missing_model_directory_stops_the_app(tmp_path):
    with pytest.raises(ModelError, match="not a directory"):
        create_app({"TESTING": True, "BLOCKGRAD_MODEL_DIR": str(tmp_path / "absent")})


@pytest.mark.slow
def test_gunicorn_does_not_start_with_a_broken_model(tmp_path, library):
    """The service itself stops: the worker cannot boot, and gunicorn exits naming the file."""
    directory = model_dir(tmp_path, library, "mixing")
    with pytest.raises(RuntimeError, match="gunicorn exited") as info:
        with gunicorn_server(workers=1, env={"BLOCKGRAD_MODEL_DIR": str(directory)}):
            pass
    assert "mixing.pt2" in str(info.value) and "does not treat pairs independently" in str(info.value)
