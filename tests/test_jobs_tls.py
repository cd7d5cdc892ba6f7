"""The embedded cluster is not an open door (issue 30): it speaks TLS only, with credentials the
service makes at each start (app/jobs/tls.py), so that a local `distributed.Client` without
them runs nothing on any port the service listens on; and no open route says where it is."""
import json
import os
import ssl
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests

from app.jobs.tls import credentials
from tests.dask_cluster import cluster_tls_env
from tools.server import wait_until

WAIT_S = 120  # bounded: the cluster starts (workers import torch) beside the session's server
CONNECT_S = 10  # each attempt's; a refusal comes at once (a TLS alert, a closed connection)
DEADLINE_S = 30  # the control's (the service's own credentials), far above what it needs; the others
# count until as long again after it ends (CONNECT_S at least): those on HTTP ports never end (see PROBE)


def http_status(port: int, path: str) -> int | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}{path}", timeout=CONNECT_S).status_code
    except requests.RequestException:  # not HTTP: a TLS listener drops it
        return None


def supervisor_of(master: int) -> psutil.Process:
    [found] = [p for p in psutil.Process(master).children() if "app.jobs.supervisor" in p.cmdline()]
    return found


def listening_ports(root: int) -> set[int]:
    """Every TCP port that `root` or a process under it listens on."""
    ports = set()
    top = psutil.Process(root)
    for process in [top, *top.children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:  # gone meanwhile (a recycled gunicorn worker)
            pass
    return ports


# Run in a process of its own, which ends soon after its control: a plain Dask Client of an
# HTTP port (distributed's HTTP servers) waits for ever, whatever its timeout.
PROBE = """
import json, os, sys, threading, time
from distributed import Client, Security
attempts, own, connect_s, deadline_s = json.loads(sys.argv[1])
securities = {"none": None, "stranger": Security.temporary(), "own": Security(require_encryption=True, **own)}
ran = {}
def attempt(address, who):
    try:
        with Client(address, timeout=connect_s, set_as_default=False, security=securities[who]) as client:
            ran[f"{who} {address}"] = [client.run_on_scheduler(os.getpid),
                                       client.submit(os.getpid, pure=False).result(timeout=connect_s)]
    except Exception:
        pass
threads = [threading.Thread(target=attempt, args=pair, daemon=True) for pair in attempts]
for thread in threads:
    thread.start()
start = time.monotonic()
threads[-1].join(deadline_s)  # the control: every other attempt started before it
# An open door does what the control did: given as long again (CONNECT_S at least), it has run.
end = time.monotonic() + max(connect_s, time.monotonic() - start)
for thread in threads:
    thread.join(max(0, end - time.monotonic()))
print(json.dumps(ran), flush=True)
os._exit(0)
"""


def what_runs(attempts: list[tuple[str, str]], own: dict) -> dict[str, list]:
    """{"WHO ADDRESS": the pids it ran in} for each (address, who) attempt whose `distributed.Client`
    ran code on the scheduler and through a task, all tried at once; who: `none` (no TLS
    configuration), `stranger` (a certificate of another CA: Security.temporary()) or `own` (the
    Security arguments `own`). The last attempt is the control: the others count if they have
    run by as long again after it ends."""
    assert attempts[-1][1] == "own", "the control comes last"
    env = {name: value for name, value in os.environ.items() if not name.startswith("DASK_")}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([attempts, own, CONNECT_S, DEADLINE_S])],
                         env=env, capture_output=True, text=True, timeout=DEADLINE_S + WAIT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_credentials_are_dask_configuration_for_every_role_made_afresh():
    import dask.config
    from distributed import Security

    env = credentials()
    assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    comm = dask.config.collect_env(env)["distributed"]["comm"]  # as a Dask process reads its environment
    assert comm["require_encryption"] is True
    tls = comm["tls"]
    for role in ("scheduler", "worker", "client"):  # each loads as Dask loads it (PEM text, no file)
        pems = {f"tls_{role}_{part}": tls[role][part] for part in ("cert", "key")}
        security = Security(tls_ca_file=tls["ca_file"], **pems)
        assert security.get_listen_args(role)["ssl_context"].verify_mode == ssl.CERT_REQUIRED  # mutual
    assert credentials()["DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY"] != env["DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY"]


@pytest.mark.slow
def test_a_local_client_without_the_credentials_runs_nothing_on_any_port(served):
    """Every port of the served process tree (gunicorn's HTTP and gRPC, the scheduler's, each
    nanny's and worker's, their HTTP servers), tried as tcp:// without credentials and as tls:// with a
    certificate of another CA: nothing runs. The control: with the service's own credentials
    the same probe runs code on the scheduler, which is among the ports tried."""
    supervisor = supervisor_of(served.pid)
    port, workers = supervisor.cmdline()[3:5]
    scheduler = f"tls://127.0.0.1:{port}"

    def cluster():
        return requests.get(served.url + "/readyz", timeout=WAIT_S).json()["cluster"]
    assert wait_until(lambda: cluster()["workers"] == int(workers), WAIT_S, 0.5), f"{workers} workers: {cluster()}"
    ports = listening_ports(served.pid)
    # gunicorn's HTTP and gRPC; the scheduler's, each worker's and each nanny's; the scheduler's and
    # each worker's HTTP
    assert {served.port, served.grpc_port, int(port)} <= ports and len(ports) == 4 + 3 * int(workers), ports
    env = {name.split("__", 3)[-1]: value for name, value in cluster_tls_env(scheduler).items()}
    own = {"tls_ca_file": env.get("CA_FILE"), "tls_client_cert": env.get("CLIENT__CERT"),
           "tls_client_key": env.get("CLIENT__KEY")}
    attempts = [(f"{scheme}://127.0.0.1:{p}", who) for p in sorted(ports)
                for scheme, who in (("tcp", "none"), ("tls", "stranger"))]
    ran = what_runs([*attempts, (scheduler, "own")], own)
    assert set(ran) == {f"own {scheduler}"}, f"an open door (or the control failed): {ran}"
    # the supervisor has the credentials, gunicorn's master and workers (never Dask clients) do not
    assert own["tls_client_key"] and not [p for p in [served.pid, *served.worker_pids()] if any(
        name.startswith("DASK_DISTRIBUTED__COMM__TLS") for name in psutil.Process(p).environ())]
    # distributed's HTTP servers answer their health route alone (no task keys, logs, addresses)
    health = [p for p in ports - {served.port, served.grpc_port} if http_status(p, "/health") == 200]
    assert len(health) == 1 + int(workers), health  # the scheduler's and each worker's
    for path in ("/json/identity.json", "/info/main/workers.html", "/metrics", "/statics/"):
        assert {p: http_status(p, path) for p in health} == dict.fromkeys(health, 404), path


@pytest.mark.slow
def test_no_open_route_says_where_the_scheduler_is(served):
    port = supervisor_of(served.pid).cmdline()[3]
    for path in ("/readyz", "/metrics", "/openapi.json"):
        body = requests.get(served.url + path, timeout=WAIT_S).text
        assert f"127.0.0.1:{port}" not in body and f":{port}" not in body, path
    assert set(requests.get(served.url + "/readyz", timeout=WAIT_S).json()["cluster"]) == {
        "store", "reachable", "workers"}


def test_readyz_reports_the_runners_workers_never_waiting_for_the_store(tmp_path, monkeypatch):
    """The workers come from the runners' heartbeats in the store, read beside the request: a
    /readyz answers while that read hangs, a later one has its value, and none names the
    scheduler the heartbeat names."""
    from app import create_app
    from app.jobs import db

    client = create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    db.beat(db.open_store(f"sqlite:///{tmp_path}/jobs.sqlite3"), "runner-a", "tls://127.0.0.1:45678", 3, time.time())
    reading, release = threading.Event(), threading.Event()
    real = db.cluster_workers

    def hanging(*args):
        reading.set()
        release.wait(WAIT_S)
        return real(*args)
    monkeypatch.setattr(db, "cluster_workers", hanging)
    try:
        first = client.get("/readyz")
        assert reading.wait(WAIT_S), "/readyz started no read of the store"
        assert first.status_code == 200
        assert first.get_json()["cluster"] == {"store": "sqlite", "reachable": False, "workers": 0}  # not read yet
    finally:
        release.set()

    def cluster():
        return client.get("/readyz").get_json()["cluster"]
    assert wait_until(lambda: cluster()["workers"] == 3, WAIT_S, 0.05), cluster()
    assert cluster() == {"store": "sqlite", "reachable": True, "workers": 3}
    assert "45678" not in client.get("/readyz").get_data(as_text=True)


def test_a_tls_address_without_tls_configuration_is_an_outage_not_a_failing_step(tmp_path, caplog):
    """An operator's external tls:// scheduler without Dask's TLS variables: distributed refuses
    the connection with a TypeError (and every later Client of the process); the runner says once
    that it waits on the cluster, naming what is missing, and
    keeps its jobs queued, instead of logging a failed step at every poll."""
    from app.core.objectives import OBJECTIVES
    from app.jobs import db
    from app.jobs.runner import Runner
    from app.jobs.settings import JobSettings

    settings = JobSettings.from_env({"BLOCKGRAD_DATA_DIR": str(tmp_path)})
    runner = Runner(settings, OBJECTIVES, db.open_store(settings.database_url()), "tls://127.0.0.1:9")
    with caplog.at_level("INFO", logger="blockgrad.jobs"):
        for _ in range(3):
            runner.step(time.time())
    assert (runner.client, runner.outage) == (None, "cluster")
    waiting = [r.getMessage() for r in caplog.records if "jobs_waiting" in r.getMessage()]
    assert len(waiting) == 1 and "needs Dask's TLS configuration" in waiting[0], caplog.text
