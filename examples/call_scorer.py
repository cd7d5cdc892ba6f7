"""Call a served model objective from Python, through /v1 (JSON) and /v2 (binary tensors).

    BLOCKGRAD_MODEL_DIR=models make serve   # with models/relnet.pt2 from export_scorer.py
    python -m examples.call_scorer relnet --dim 64   # from the repository root
"""
import argparse

import numpy as np
import requests

from tools.infer_client import binary_infer_request, read_infer_response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("objective")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    listed = requests.get(f"{args.url}/v1/objectives", timeout=10).json()["objectives"]
    print([(o["name"], o["kind"], o["dim"], o["dtypes"]) for o in listed])

    vectors = np.random.default_rng(0).standard_normal((32, args.dim)).astype(np.float32)  # (N, D)
    answer = requests.post(f"{args.url}/v1/gradients", timeout=60, json={
        "vectors": vectors.tolist(), "objective": args.objective, "outputs": ["accumulated", "losses"]})
    answer.raise_for_status()
    body = answer.json()
    print("v1:", body["factor"], "x", body["factor"], "blocks; accumulated", np.shape(body["accumulated"]))

    request_body, headers = binary_infer_request(vectors, {"objective": args.objective, "factor": 4})
    answer = requests.post(f"{args.url}/v2/models/blockgrad/infer", data=request_body, headers=headers, timeout=60)
    answer.raise_for_status()
    _, tensors = read_infer_response(answer.content, answer.headers)
    print("v2:", {name: array.shape for name, array in tensors.items()})


if __name__ == "__main__":
    main()
