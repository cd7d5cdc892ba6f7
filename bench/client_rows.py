"""The client package's row: /v1 read block by block (blockgrad_client) against the whole
body read and parsed at once (requests + json), both ending in numpy arrays."""
import gc
import tracemalloc

import numpy as np
import requests
from blockgrad_client import Client

from . import workloads
from .measure import Result, ms, paired


def whole_body(session: requests.Session, url: str, vectors: np.ndarray, fields: dict) -> list:
    """What a hand-written caller does: the body, then json, then arrays."""
    response = session.post(url + "/v1/gradients", json={"vectors": vectors.tolist(), **fields}, timeout=300)
    response.raise_for_status()
    document = response.json()
    return [np.asarray(block["gradient"], dtype=np.float32) for block in document["blocks"]]


def peak_bytes(fn) -> int:
    """The most memory Python and numpy held at once while `fn` ran (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def client_v1_read(bench) -> list[Result]:
    server = bench.server()
    n, dim, factor = 256, 32, 4  # 4.2M gradient numbers, ~40 MB of JSON
    vectors = workloads.vectors(n, dim).astype(np.float32)
    fields = {"factor": factor, "outputs": ["blocks", "accumulated"]}
    session = requests.Session()
    with Client(server.url, timeout=300) as client:
        def by_client():
            return client.gradients(vectors, **fields)

        def by_hand():
            return whole_body(session, server.url, vectors, fields)

        mine, theirs = by_client(), by_hand()  # warm-up, and proof of the same numbers
        if not all(np.array_equal(a.gradient, b) for a, b in zip(mine.blocks, theirs)):
            raise RuntimeError("the client and json disagree on the blocks")
        del mine, theirs
        memory = peak_bytes(by_client) / peak_bytes(by_hand)
        times = paired(by_client, by_hand, repeats=3)
    return [Result(f"client: /v1 read block by block vs whole body + json, N={n} D={dim} F={factor}",
                   "-", f"memory {memory:.2f}x, time {times.ratio:.2f}x", "-",
                   f"peak Python+numpy memory (tracemalloc) ratio; client {ms(times.a_s)}, "
                   f"requests + json.loads {ms(times.b_s)}")]
