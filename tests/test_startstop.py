"""Start and stop like a production server (issue 28, point 5), on gunicorn as `make serve`
starts it (tools/server.py):

- SIGTERM to the master: a new connect is refused (every process closed its listening
  socket), while a request in flight, held waiting for a compute slot the test holds
  (HeldSlots), still gets its whole 200 once let go;
- a non-loopback bind without BLOCKGRAD_API_TOKEN refuses to start (one line, exit status
  non-zero) unless BLOCKGRAD_AUTH=off, which starts with one warning; with a token it starts;
- a start and SIGTERM of the process group (a terminal's Ctrl-C, tools/server.py's stop) with
  the embedded Dask cluster leaves no "leaked semaphore" warning and no traceback.

Verdicts are counts and events (refused or not, a status, lines of the log), never times;
every wait is bounded by WAIT_S, reached only on failure.
"""
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import requests

from tests.events import HeldSlots, background
from tests.oracle import assert_matches_oracle, request_oracle
from tools.server import ROOT, free_port, gunicorn_command, gunicorn_server, wait_until

pytestmark = pytest.mark.slow

WAIT_S = 120
REQUEST = {"vectors": [[0.5, 1.0], [1.5, 2.0], [2.5, 3.0], [3.5, 4.5]], "factor": 2,
           "outputs": ["blocks", "accumulated", "losses"]}
REFUSAL = "BLOCKGRAD_API_TOKEN"


def refused(port: int) -> bool:
    """Whether a new connect to the port is refused (ECONNREFUSED) now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a reset or timeout: not a refusal
        return False


def test_sigterm_refuses_new_connections_and_answers_the_request_in_flight():
    with gunicorn_server(workers=2) as server:
        thread, answers = background(lambda: requests.post(server.url + "/v1/gradients", json=REQUEST, timeout=WAIT_S))
        with HeldSlots(server) as held:
            thread.start()
            assert wait_until(lambda: held.waiting() == 1, WAIT_S), ("the request never waited for a slot", answers)
            os.kill(server.pid, signal.SIGTERM)
            assert wait_until(lambda: refused(server.port), WAIT_S), "new connections still accepted after SIGTERM"
            assert answers == []  # certainly still in flight: every slot is held
        thread.join(WAIT_S)
        [answer] = answers
        assert not isinstance(answer, BaseException), answer
        assert answer.status_code == 200, answer.text
        assert_matches_oracle(REQUEST, answer.json(), request_oracle(REQUEST))
        assert server.process.wait(WAIT_S) == 0


class Started:
    """gunicorn started from this environment with `env` and `bind`; its output in a file."""

    def __init__(self, tmp_path, env: dict[str, str], bind: str):
        self.log = tmp_path / "gunicorn.log"
        with open(self.log, "wb") as log:  # a job store of its own, never the checkout's ./data
            self.process = start({"BLOCKGRAD_DATA_DIR": str(tmp_path / "data"), **env}, bind, log)

    def finish(self) -> tuple[int, str]:
        """Its exit status (waited for) and whole output: read once no process (the embedded
        cluster's, in a session of their own, included) still holds the log open."""
        self.process.wait(WAIT_S)
        assert wait_until(lambda: not holders(self.log), WAIT_S), ("still writing the log", holders(self.log))
        return self.process.returncode, self.log.read_text()


def holders(path) -> list[str]:
    """Processes with `path` open (Linux: their /proc/<pid>/fd links)."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                found.append(fd.parts[2])
        except OSError:  # gone, or not ours to read
            pass
    return found


def start(env: dict[str, str], bind: str, log) -> subprocess.Popen:
    full = {**os.environ, "BLOCKGRAD_DASK_SCHEDULER": "off", "WEB_CONCURRENCY": "1", "BLOCKGRAD_DEVICE": "cpu",
            "BLOCKGRAD_GRPC_BIND": f"127.0.0.1:{free_port()}", **env, "BLOCKGRAD_BIND": bind}
    for name in ("BLOCKGRAD_API_TOKEN", "BLOCKGRAD_AUTH"):
        if name not in env:
            full.pop(name, None)
    return subprocess.Popen(gunicorn_command(), cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def answers(port: int, path: str = "/healthz", token: str | None = None) -> str | None:
    try:
        answer = requests.get(f"http://127.0.0.1:{port}{path}", timeout=10,
                              headers={"Authorization": f"Bearer {token}"} if token else {})
    except requests.RequestException:
        return None
    return answer.text if answer.status_code == 200 else None


def serves_then_stops(started: Started, port: int, ready=None) -> str:
    """Wait until the server answers /healthz on loopback (and `ready()`), SIGTERM its process
    group; its whole output."""
    ready = ready or (lambda: answers(port) is not None)
    process = started.process
    try:
        up = wait_until(lambda: process.poll() is not None or ready(), WAIT_S)
        assert up and process.poll() is None, ("the server did not start", started.log.read_text())
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    status, output = started.finish()
    assert status == 0, output
    return output


def test_a_public_bind_without_a_token_refuses_to_start(tmp_path):
    status, output = Started(tmp_path, {}, f"0.0.0.0:{free_port()}").finish()
    assert status != 0
    [line] = [line for line in output.splitlines() if REFUSAL in line]
    assert "BLOCKGRAD_AUTH=off" in line and "Booting worker" not in output, output


def test_a_public_bind_starts_with_a_token(tmp_path):
    port = free_port()
    output = serves_then_stops(Started(tmp_path, {"BLOCKGRAD_API_TOKEN": "s3cret"}, f"0.0.0.0:{port}"), port)
    assert REFUSAL not in output, output


def test_a_public_bind_with_auth_off_starts_and_warns_once(tmp_path):
    port = free_port()
    output = serves_then_stops(Started(tmp_path, {"BLOCKGRAD_AUTH": "off"}, f"0.0.0.0:{port}"), port)
    assert sum("BLOCKGRAD_AUTH=off" in line for line in output.splitlines()) == 1, output


def test_a_loopback_bind_needs_no_token(tmp_path):
    port = free_port()
    output = serves_then_stops(Started(tmp_path, {}, f"127.0.0.1:{port}"), port)
    assert "BLOCKGRAD_AUTH" not in output, output


def test_a_bad_auth_value_refuses_to_start_naming_it(tmp_path):
    status, output = Started(tmp_path, {"BLOCKGRAD_AUTH": "maybe"}, f"127.0.0.1:{free_port()}").finish()
    assert status != 0 and "BLOCKGRAD_AUTH" in output, output


def test_a_stop_leaves_no_warning_behind(tmp_path):
    """`make serve`'s start, the embedded cluster's workers joined, then SIGTERM to the whole
    process group, as tools/server.py's stop (or a terminal's Ctrl-C, SIGINT) sends it."""
    port = free_port()
    started = Started(tmp_path, {"BLOCKGRAD_DASK_SCHEDULER": "", "WEB_CONCURRENCY": "2"}, f"127.0.0.1:{port}")
    joined = re.compile(r"^blockgrad_cluster_workers 2\.0$", re.MULTILINE)
    output = serves_then_stops(started, port, lambda: joined.search(answers(port, "/metrics") or "") is not None)
    assert "Booting worker" in output, output
    assert "leaked semaphore" not in output and "Traceback" not in output, output
