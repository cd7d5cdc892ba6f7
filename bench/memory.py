"""Peak worker memory per request case, against real gunicorn, beside the admission's
prediction (app/core/admission.py): `python -m bench.memory [CASE ...]`.

Each case runs on a fresh worker (the previous one is killed and replaced): after a tiny
warm-up request on the same route, the worker's peak RSS is reset (/proc/<pid>/clear_refs
"5") and its RSS read; the case's peak is VmHWM after the request minus that RSS, i.e.
what the request added. Loopback only; one worker; every wait bounded.
"""
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import orjson
import requests

from app.api.v1.gradients import answer_cost as v1_answer_cost
from app.api.v2.infer import answer_cost as v2_answer_cost
from app.api.v2.infer import RequestedOutput
from app.api.v2.model import OUTPUTS as V2_OUTPUTS
from app.core.admission import predict_peak_bytes
from app.core.request import Sizes, ordered_outputs
from app.core.settings import Settings
from blockgrad_client.infer import binary_infer_request
from tools.server import gunicorn_server, peak_rss_kib, rss_kib, wait_until

MB = 1024 * 1024
INFER = "/v2/models/blockgrad/infer"


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    dim: int
    factor: int
    objective: str
    dtype: str
    outputs: tuple[str, ...]  # /v1 names, or /v2 names with ":json" / ":binary"
    encoding: str  # v1_json, v2_json, v2_binary

    def body(self) -> tuple[str, bytes, dict]:
        vectors = np.random.default_rng(0).standard_normal((self.n, self.dim)).astype(self.dtype)
        if self.encoding == "v1_json":
            document = {"vectors": vectors.tolist(), "factor": self.factor, "objective": self.objective,
                        "dtype": self.dtype, "outputs": list(self.outputs)}
            return "/v1/gradients", orjson.dumps(document), {"Content-Type": "application/json"}
        names = [name.split(":")[0] for name in self.outputs]
        binary = {name.split(":")[0]: name.endswith(":binary") for name in self.outputs}
        parameters = {"factor": self.factor, "objective": self.objective}
        if self.encoding == "v2_binary":
            body, headers = binary_infer_request(vectors, parameters, names, binary_output=False)
            document_end = int(headers["Inference-Header-Content-Length"])
            document = orjson.loads(body[:document_end])
        else:
            document = {"inputs": [{"name": "vectors", "shape": [self.n, self.dim],
                                    "datatype": "FP32" if self.dtype == "float32" else "FP64",
                                    "data": vectors.reshape(-1).tolist()}], "parameters": parameters}
            body, headers = b"", {"Content-Type": "application/json"}
        document["outputs"] = [{"name": name, "parameters": {"binary_data": binary[name]}} for name in names]
        header = orjson.dumps(document)
        if self.encoding == "v2_binary":
            headers = {**headers, "Inference-Header-Content-Length": str(len(header))}
            return INFER, header + body[document_end:], headers
        return INFER, header, headers

    def prediction(self, body_bytes: int, settings: Settings) -> int:
        if self.encoding == "v1_json":
            outputs, answer = self.outputs, v1_answer_cost(body_bytes, self.dtype)
        else:
            requested = tuple(RequestedOutput(name.split(":")[0], name.endswith(":binary")) for name in self.outputs)
            outputs = ordered_outputs({V2_OUTPUTS[output.name] for output in requested} - {None})
            answer = v2_answer_cost(self.dtype, requested, body_bytes, binary_input=self.encoding == "v2_binary")
        return predict_peak_bytes(Sizes(self.n, self.dim, self.factor, outputs, self.objective, self.dtype), answer,
                                  settings)


ALL = ("blocks", "accumulated", "losses")
V2_ALL_JSON = ("block_gradients:json", "accumulated:json", "bounds:json", "losses:json")
V2_ALL_BINARY = ("block_gradients:binary", "accumulated:binary", "bounds:binary", "losses:binary")
CASES = [
    Case("v1 N=700 D=64 F=4 all f64 logsumexp", 700, 64, 4, "logsumexp", "float64", ALL, "v1_json"),
    Case("v1 N=700 D=64 F=4 all f32 l2_norm", 700, 64, 4, "l2_norm", "float32", ALL, "v1_json"),
    Case("v1 N=4096 D=64 F=64 accumulated f32 sum", 4096, 64, 64, "sum", "float32", ("accumulated",), "v1_json"),
    Case("v1 N=2048 D=64 F=32 accumulated f64 logsumexp", 2048, 64, 32, "logsumexp", "float64",
         ("accumulated",), "v1_json"),
    Case("v1 N=512 D=64 F=16 blocks f32 sum", 512, 64, 16, "sum", "float32", ("blocks", "accumulated"), "v1_json"),
    Case("v2 json N=512 D=64 F=16 all f32", 512, 64, 16, "sum", "float32", V2_ALL_JSON, "v2_json"),
    Case("v2 binary N=512 D=64 F=16 all f64 logsumexp", 512, 64, 16, "logsumexp", "float64", V2_ALL_BINARY,
         "v2_binary"),
    Case("v2 binary N=1024 D=32 F=8 mixed f64 logsumexp", 1024, 32, 8, "logsumexp", "float64",
         ("block_gradients:json", "bounds:binary"), "v2_binary"),
    Case("v2 binary N=2048 D=8 F=32 block_gradients f64 (the largest grid)", 2048, 8, 32, "sum", "float64",
         ("block_gradients:binary",), "v2_binary"),
    Case("v2 json N=2048 D=8 F=32 block_gradients f64 (the largest grid)", 2048, 8, 32, "sum", "float64",
         ("block_gradients:json",), "v2_json"),
    Case("v2 binary N=4096 D=64 F=64 accumulated f32", 4096, 64, 64, "sum", "float32", ("accumulated:binary",),
         "v2_binary"),
]


def worker(server) -> int:
    assert wait_until(lambda: len(server.worker_pids()) == 1 and server.answers("/healthz"), 120, 0.2)
    return server.worker_pids()[0]


def measure(server, case: Case, settings: Settings) -> tuple[int, int, int, float]:
    """(peak bytes the request added, prediction, status, seconds) on a fresh worker."""
    path, body, headers = case.body()
    pid = worker(server)
    tiny = Case(case.name, 3, 2, 1, "sum", case.dtype, case.outputs, case.encoding)
    tiny_path, tiny_body, tiny_headers = tiny.body()
    requests.post(server.url + tiny_path, data=tiny_body, headers=tiny_headers, timeout=60)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = rss_kib(pid) * 1024
    start = time.monotonic()
    with requests.post(server.url + path, data=body, headers=headers, timeout=300, stream=True) as response:
        for _ in response.iter_content(1 << 20):
            pass
        status = response.status_code
    elapsed = time.monotonic() - start
    peak = peak_rss_kib(pid) * 1024 - before
    os.kill(pid, signal.SIGKILL)  # a fresh worker for the next case
    wait_until(lambda: pid not in server.worker_pids(), 30, 0.1)
    return peak, case.prediction(len(body), settings), status, elapsed


def main(names: list[str]) -> int:
    cases = [case for case in CASES if not names or any(name in case.name for name in names)]
    env = {"BLOCKGRAD_WORKER_MEMORY_BYTES": str(64 * 1024 ** 3), "BLOCKGRAD_REQUEST_TIMEOUT_S": "600",
           "BLOCKGRAD_COST_PER_BLOCK_S": "1e-9", "BLOCKGRAD_COST_PER_NUMBER_S": "1e-12"}
    settings = Settings.from_env({**os.environ, **env})
    print("| case | status | measured peak (MB) | predicted (MB) | predicted / measured | s |")
    print("|---|---|---|---|---|---|")
    with gunicorn_server(workers=1, env=env) as server:
        for case in cases:
            peak, predicted, status, elapsed = measure(server, case, settings)
            print(f"| {case.name} | {status} | {peak / MB:.0f} | {predicted / MB:.0f} | "
                  f"{predicted / max(peak, 1):.2f} | {elapsed:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
