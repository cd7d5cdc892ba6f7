"""Build and export a relation-network-style pair scorer for BLOCKGRAD_MODEL_DIR.

    .venv/bin/python examples/export_scorer.py models/relnet.pt2 --dim 64 --hidden 256
    BLOCKGRAD_MODEL_DIR=models make serve      # objective "relnet" (the file's stem)

The scorer is g(v_i, v_j) = MLP(concat(v_i, v_j)), one score per pair; a block's
loss is the sum of its pairs' scores, so the service's gradients are those of
sum_{i,j} g(v_i, v_j) taken block by block, each block detached as its own leaf.
The program is exported with a dynamic number of pairs P: its input is (P, 2D).
Replace `PairScorer` with your own trained module (load its state_dict first); it
must score each pair on its own (no normalisation across the batch), which the
service checks when it loads the file.
"""
import argparse
from pathlib import Path

import torch
from torch.export import Dim


class PairScorer(torch.nn.Module):
    """(P, 2D) pairs concat(v_i, v_j) -> (P,) scores: Linear(2D, hidden), ReLU, Linear(hidden, 1)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.mlp(pairs).squeeze(-1)  # (P,)


def export_scorer(path: Path, dim: int, hidden: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save PairScorer(dim, hidden) as an exported program at `path` (`<name>.pt2`)."""
    torch.manual_seed(seed)
    module = PairScorer(dim, hidden).to(dtype).eval()
    example = torch.randn(8, 2 * dim, dtype=dtype)  # (P, 2D); P is dynamic below
    program = torch.export.export(module, (example,), dynamic_shapes=({0: Dim("pairs")},))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="where to write the program, e.g. models/relnet.pt2")
    parser.add_argument("--dim", type=int, default=64, help="vector length D (pairs are 2D long)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden units of the MLP")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()
    export_scorer(args.path, args.dim, args.hidden, getattr(torch, args.dtype))
    print(f"wrote {args.path}: objective {args.path.stem!r}, D = {args.dim}, {args.dtype}")


if __name__ == "__main__":
    main()
