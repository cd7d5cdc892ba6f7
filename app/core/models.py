"""Objectives loaded from the operator's model directory (BLOCKGRAD_MODEL_DIR).

Each `<name>.pt2` there is an exported program (`torch.export.save`) whose forward
maps pairs (P, 2D) to P scores, (P,) or (P, 1), with P dynamic. A block's loss is
the sum of the scores of its pairs. Every file is loaded and checked once, when
the app is created: under gunicorn (no preload_app) that is in each worker after
the fork, on CPU; a worker computing on CUDA moves its own copy of the module to
the card the first time a request uses it there (`ModelObjective.module_on`).
A file that fails a check raises ModelError naming the file and the failure, and
the service does not start.

Exported programs are never cast: a model serves the one dtype it was exported with.
"""
import copy
import io
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODEL_SUFFIX = ".pt2"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
MODEL_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
# Batch vs group-by-group agreement: within the dtype's rounding, not bitwise.
INDEPENDENCE_RTOL = {"float32": 1e-5, "float64": 1e-12}
PROBE_PAIRS = 64
PROBE_GROUPS = (1, 2, 5, 8, 16, 32)  # sums to PROBE_PAIRS; 1 as the engine's F = N blocks
MEMORY_PROBE_PAIRS = (64, 320)  # two sizes: the slope drops weights and other constants
PEAK_FACTOR = 3  # peak activations / saved activations, at most (measure_bytes_per_pair)
PROBE_SEED = 12345


class ModelError(Exception):
    """A model file that cannot be served; the message names the file and what failed."""


@dataclass(eq=False)
class ModelObjective:
    """A block objective backed by an exported program: L(B) = sum of the scores of B's pairs."""
    name: str
    file: Path
    size_bytes: int
    parameter_count: int
    dim: int  # D: the program takes pairs of length 2D
    dtype: str  # the one dtype it was exported with
    bytes_per_pair: int  # estimated peak activation bytes per pair (measure_bytes_per_pair)
    module: torch.nn.Module = field(repr=False)
    program: bytes = field(default=b"", repr=False)  # the file as loaded: what a job ships to its workers
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return (self.dtype,)

    @property
    def description(self) -> str:
        return (f"Sum of the scores of the block's pairs under the exported program {self.file.name} "
                f"({self.size_bytes} bytes, {self.parameter_count} parameters, D = {self.dim}, {self.dtype}).")

    def module_on(self, device: torch.device) -> torch.nn.Module:
        """The module on `device`: the loaded one on CPU, a moved copy (made once) elsewhere."""
        if device.type == "cpu":
            return self.module
        if device not in self._on_device:
            self._on_device[device] = copy.deepcopy(self.module).to(device)  # the CPU module stays as loaded
        return self._on_device[device]

    def losses(self, blocks: torch.Tensor, offset: float) -> torch.Tensor:
        """(k, h, w, 2D) equal-shaped blocks -> (k,) losses; each depends only on its own block
        (checked at load: the program treats pairs independently)."""
        k, h, w, two_d = blocks.shape
        pairs = blocks.reshape(k * h * w, two_d)  # (P, 2D)
        scores = self.module_on(blocks.device)(pairs)  # (P,) or (P, 1)
        return scores.reshape(k, h * w).sum(dim=1)  # (k,)


def load_models(model_dir: str | None, builtin_names: Collection[str]) -> dict[str, ModelObjective]:
    """Every `<name>.pt2` in `model_dir`, loaded and checked, by name (sorted); {} without a directory."""
    if not model_dir:
        return {}
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelError(f"BLOCKGRAD_MODEL_DIR={model_dir!r} is not a directory.")
    models = {}
    for path in sorted(directory.glob(f"*{MODEL_SUFFIX}")):
        name = path.name[:-len(MODEL_SUFFIX)]
        if not NAME_PATTERN.fullmatch(name):
            raise ModelError(f"{path}: the objective's name {name!r} (the file's stem) may hold only "
                             "letters, digits, '_' and '-'; rename the file.")
        if name in builtin_names:
            raise ModelError(f"{path}: the name {name!r} is a built-in objective's; rename the file.")
        models[name] = load_model(name, path)
    return models


def load_model(name: str, path: Path, data: bytes | None = None) -> ModelObjective:
    """The program in `path` (or `data`, its bytes, read elsewhere), checked."""
    try:
        data = path.read_bytes() if data is None else data
        program = torch.export.load(io.BytesIO(data))
    except Exception as exc:  # any failure to read: the message says which file
        raise ModelError(f"{path}: cannot be loaded as an exported program (torch.export.save): "
                         f"{type(exc).__name__}: {exc}") from None
    dim, dtype = input_signature(path, program)
    module = program.module()
    for parameter in module.parameters():
        parameter.requires_grad_(False)  # only the input's gradient is ever asked for
    check_probe(path, module, dim, dtype)
    return ModelObjective(name=name, file=path, size_bytes=len(data),
                          parameter_count=sum(p.numel() for p in module.parameters()), dim=dim,
                          dtype=MODEL_DTYPES[dtype], bytes_per_pair=measure_bytes_per_pair(module, dim, dtype),
                          module=module, program=data)


def input_signature(path: Path, program) -> tuple[int, torch.dtype]:
    """D and dtype from the program's one input (P, 2D): P symbolic, 2D a fixed even number."""
    inputs = program.graph_signature.user_inputs
    if len(inputs) != 1:
        raise ModelError(f"{path}: the program takes {len(inputs)} inputs; it must take one, the pairs (P, 2D).")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == inputs[0])
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        raise ModelError(f"{path}: the input has shape {shape}; it must be the pairs (P, 2D).")
    pairs, width = value.shape
    if not isinstance(pairs, torch.SymInt):
        raise ModelError(f"{path}: the number of pairs is fixed at {pairs}; export it dynamic, "
                         "dynamic_shapes=({0: torch.export.Dim('pairs')},).")
    if not isinstance(width, int) or width < 2 or width % 2:
        raise ModelError(f"{path}: the pair length {width} must be a fixed even number 2D.")
    if value.dtype not in MODEL_DTYPES:
        raise ModelError(f"{path}: the input's dtype is {value.dtype}; it must be float32 or float64.")
    return width // 2, value.dtype


def scores_and_gradient(module: torch.nn.Module, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (P,) and d sum(scores) / d pairs (P, 2D), the pairs as their own leaf."""
    leaf = pairs.detach().requires_grad_(True)  # (P, 2D)
    with torch.enable_grad():
        scores = module(leaf)
        (grad,) = torch.autograd.grad(scores.sum(), leaf)
    return scores.detach(), grad


def probe_run(path: Path, module: torch.nn.Module, pairs: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scores_and_gradient on `pairs`; a failure is a ModelError that says on `what`."""
    try:
        return scores_and_gradient(module, pairs)
    except Exception as exc:
        raise ModelError(f"{path}: fails on {what}: {type(exc).__name__}: {exc}") from None


def check_probe(path: Path, module: torch.nn.Module, dim: int, dtype: torch.dtype) -> None:
    """Runs on a probe batch, gives P finite scores, and treats pairs independently."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    pairs = torch.randn(PROBE_PAIRS, 2 * dim, generator=generator, dtype=dtype)  # (P, 2D)
    scores, grad = probe_run(path, module, pairs, f"a probe of {PROBE_PAIRS} pairs of length {2 * dim}")
    if tuple(scores.shape) not in ((PROBE_PAIRS,), (PROBE_PAIRS, 1)):
        raise ModelError(f"{path}: returns shape {tuple(scores.shape)} for {PROBE_PAIRS} pairs; "
                         f"it must return one score per pair, ({PROBE_PAIRS},) or ({PROBE_PAIRS}, 1).")
    if scores.dtype != dtype:
        raise ModelError(f"{path}: returns {scores.dtype} scores for {dtype} pairs; they must be the same.")
    if not (bool(torch.isfinite(scores).all()) and bool(torch.isfinite(grad).all())):
        raise ModelError(f"{path}: gives scores or gradients that are not finite on a standard normal probe.")
    scores = scores.reshape(PROBE_PAIRS)
    groups = [probe_run(path, module, group, f"a group of {len(group)} pairs (blocks can be that small)")
              for group in pairs.split(list(PROBE_GROUPS))]
    rtol = INDEPENDENCE_RTOL[MODEL_DTYPES[dtype]]
    for what, batch, grouped in (("scores", scores, torch.cat([s.reshape(-1) for s, _ in groups])),
                                 ("gradients", grad, torch.cat([g for _, g in groups]))):
        atol = rtol * max(1.0, float(batch.abs().max()))
        if not torch.allclose(batch, grouped, rtol=rtol, atol=atol):
            worst = float((batch - grouped).abs().max())
            raise ModelError(
                f"{path}: does not treat pairs independently: its {what} on {PROBE_PAIRS} pairs at once and "
                f"group by group {list(PROBE_GROUPS)} differ by up to {worst:.3g} (tolerance {rtol:g} relative); "
                "a pair's score must depend on that pair alone (no normalisation across the batch).")


def saved_activation_bytes(module: torch.nn.Module, pairs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, parameters excluded."""
    constant = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in constant:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    leaf = pairs.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        scores = module(leaf)
        saved.setdefault(scores.untyped_storage().data_ptr(), scores.untyped_storage().nbytes())
    return sum(saved.values())


def measure_bytes_per_pair(module: torch.nn.Module, dim: int, dtype: torch.dtype) -> int:
    """Estimated peak activation memory per pair: PEAK_FACTOR x what autograd saves for
    backward per pair (and the scores), measured as the slope between two probe sizes so
    that weights and per-call constants drop out. Rounded up.

    Why x3: the peak is the saved tensors plus what is live beside them, in the forward the
    output of the op being computed, in the backward an activation's incoming and outgoing
    gradient; each of those is at most one activation, so at most the saved total twice more.
    Measured on the example scorer (examples/export_scorer.py, D=64, hidden 256, 40,000 pairs
    at once): 3,080 bytes of peak RSS per pair against 3 x 1,028 = 3,084 charged."""
    small, large = MEMORY_PROBE_PAIRS
    generator = torch.Generator().manual_seed(PROBE_SEED)
    sizes = [saved_activation_bytes(module, torch.randn(p, 2 * dim, generator=generator, dtype=dtype))
             for p in (small, large)]  # separate tensors: a slice would report its parent's storage
    grown = sizes[1] - sizes[0]
    return max(1, math.ceil(PEAK_FACTOR * grown / (large - small)))
