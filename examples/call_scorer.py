"""Call a served model objective from Python, through /v1 (JSON) and /v2 (binary tensors).

    BLOCKGRAD_MODEL_DIR=models make serve   # with models/relnet.pt2 from export_scorer.py
    .venv/bin/pip install ./client
    .venv/bin/python examples/call_scorer.py relnet --dim 64
"""
import argparse

import numpy as np
from blockgrad_client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("objective")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    with Client(args.url) as client:
        print([(o["name"], o["kind"], o["dim"], o["dtypes"]) for o in client.objectives()])
        vectors = np.random.default_rng(0).standard_normal((32, args.dim)).astype(np.float32)  # (N, D)
        result = client.gradients(vectors, objective=args.objective, outputs=["accumulated", "losses"])
        print("v1:", result.losses.shape, "blocks; accumulated", result.accumulated.shape)
        tensors = client.infer(vectors, objective=args.objective, factor=4)
        print("v2:", {name: array.shape for name, array in tensors.items()})


if __name__ == "__main__":
    main()
