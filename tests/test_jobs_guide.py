"""docs/jobs.md's guide, run as written: its shell blocks, in order, against the service as
`make serve` starts it (the session's gunicorn with its embedded cluster and job store)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
GUIDE_S = 300  # the whole guide's bound on a loaded 2-core machine; it takes seconds


def guide_commands() -> str:
    text = (ROOT / "docs" / "jobs.md").read_text()
    guide = text.split("## Guide", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", guide, re.S)
    assert len(blocks) >= 4, "the guide lost its commands"
    return "\n".join(blocks)


@pytest.mark.slow
def test_the_guide_runs_as_written(served, tmp_path):
    script = guide_commands().replace("localhost:8000", f"127.0.0.1:{served.port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["timeout", str(GUIDE_S), "bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + done.stdout
    lines = done.stdout.splitlines()
    assert "(2048, 16) (8, 8)" in lines
    assert lines[-1] == "204"  # the DELETE
    submitted, succeeded = (json.loads(line) for line in lines[:2])
    assert submitted["status"] == "queued" and succeeded["status"] == "succeeded"
    assert succeeded["progress"] == {"blocks_done": 64, "blocks_total": 64}
    cancelled = json.loads(lines[-2])
    # The other job is cancelled while queued or running, unless the cluster finished it first:
    # then the guide's sentence about a finished job holds (409 job_done).
    assert cancelled.get("status") == "cancelled" or cancelled["error"]["code"] == "job_done", cancelled
    with np.load(tmp_path / "result.npz", allow_pickle=False) as result:
        vectors = np.load(tmp_path / "vectors.npy")
        assert result["accumulated"].shape == vectors.shape and result["losses"].shape == (8, 8)
        as_json = json.loads((tmp_path / "result.json").read_text())
        np.testing.assert_array_equal(np.asarray(as_json["accumulated"], dtype=np.float32), result["accumulated"])
    # The deleted job is gone on every route.
    for path in ("", "/result"):
        answer = requests.get(f"{served.url}/v1/jobs/{submitted['id']}{path}", timeout=60)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "job_not_found"
