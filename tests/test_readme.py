"""The README and docs/: a README of a few screens whose examples run as written, every
setting and error code documented where a reader looks for it, and the newcomer frictions
the README points at (the CPU torch index, models/ ignored, /docs opening on its operations,
a /v2 example Swagger UI can send)."""
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from app import create_app
from app.core.settings import variable_of
from app.http.settings import Settings as HttpSettings
from app.jobs.settings import JobSettings
from app.serving.settings import ServingSettings
from tools.reference import reference_accumulated, reference_blocks
from tools.server import gunicorn_server

from .test_docs import CONTRACT_ERRORS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200
NEVER_SENT = {"client_closed", "send_timeout", "worker_timeout"}  # log and metrics codes only


@pytest.fixture
def spec(client):
    return client.get("/openapi.json").get_json()


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, re.S | re.M)


def section(markdown: str, heading: str) -> str:
    """The text under `heading` (a whole line) up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = markdown.index(f"\n{heading}\n")
    rest = markdown[start + len(heading) + 2:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def first_cells(markdown: str) -> list[str]:
    """The first cell of every table row (header and separator rows included)."""
    return [line.split("|")[1] for line in markdown.splitlines() if line.startswith("|")]


def backticked(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_fits_a_few_screens():
    lines = text(README).splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def test_readme_links_every_docs_file():
    readme = text(README)
    documents = sorted(DOCS.glob("*.md"))
    assert len(documents) >= 3
    for document in documents:
        assert f"](docs/{document.name})" in readme, document.name


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_links_to_existing_files_name_their_headings(path):
    """A link's anchor names a heading of its target; a link to code or a folder names a real path."""
    for target, anchor in re.findall(r"\]\(([^)#\s:]*)(?:#([^)\s]+))?\)", text(path)):
        resolved = (path.parent / target).resolve() if target else path
        if resolved.suffix != ".md":
            assert resolved.exists(), (path.name, target)
        if anchor and resolved.exists():
            headings = re.findall(r"^#+ (.+)$", text(resolved), re.M)
            assert anchor in {slug(heading) for heading in headings}, (path.name, target, anchor)


def variables_in_code() -> set[str]:
    sources = [*(ROOT / "app").rglob("*.py"), ROOT / "gunicorn.conf.py", ROOT / "wsgi.py"]
    names = {name for source in sources for name in re.findall(r"\bBLOCKGRAD_[A-Z0-9_]+", text(source))}
    return {name for name in names if not name.endswith("_")}


def test_every_environment_variable_is_in_the_configuration_table():
    table = section(text(DOCS / "configuration.md"), "## Environment variables")
    documented = set().union(*(backticked(cell) for cell in first_cells(table)))
    layers = (HttpSettings, JobSettings, ServingSettings)  # every layer's settings (the HTTP layer's include the core's)
    read = {variable_of(item) for layer in layers for item in fields(layer)} | variables_in_code() | {
        "BLOCKGRAD_BIND", "WEB_CONCURRENCY", "PROMETHEUS_MULTIPROC_DIR"}
    assert read - documented == set()
    stale = {name for name in documented if name.startswith("BLOCKGRAD_")} - read
    assert stale == set()  # no row for a variable nothing reads


def test_every_gunicorn_setting_is_in_the_configuration_table(monkeypatch):
    from gunicorn.config import KNOWN_SETTINGS

    for name in ("WEB_CONCURRENCY", "GUNICORN_CMD_ARGS"):
        monkeypatch.delenv(name, raising=False)
    conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    settings = {setting.name for setting in KNOWN_SETTINGS}
    configured = {name for name, value in conf.items() if name in settings and not callable(value)}
    assert {"bind", "workers", "worker_class", "threads", "timeout"} <= configured
    table = section(text(DOCS / "configuration.md"), "## gunicorn settings")
    documented = set().union(*(backticked(cell) for cell in first_cells(table)))
    assert configured - documented == set()


def documented_errors() -> dict[str, str]:
    """code -> status cell of docs/api.md's error table."""
    rows = re.findall(r"^\| (\S+) \| `([a-z_]+)` \|", section(text(DOCS / "api.md"), "## Errors"), re.M)
    return {code: status for status, code in rows}


def test_every_error_code_is_in_the_error_table(app):
    documented = documented_errors()
    for code, status in CONTRACT_ERRORS.items():  # the contract's literal statuses
        assert documented.get(code) == str(status), code
    description = app.test_client().get("/openapi.json").get_json()["info"]["description"]
    served = dict((code, status) for status, code in re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", description, re.M))
    assert len(served) >= len(CONTRACT_ERRORS)
    for code, status in served.items():  # every code the server documents, with its status
        expected = f"({status})" if code in NEVER_SENT else status
        assert documented.get(code) == expected, code
    for code in NEVER_SENT:
        assert documented.get(code, "").startswith("("), code


def curl_examples() -> list[tuple[str, str, dict, str]]:
    """(first line, path, body, the JSON block that follows) of each README curl example."""
    readme = text(README)
    found = []
    for match in re.finditer(r"^```sh\n(curl .*?)^```\n(.*?)^```json\n(.*?)^```", readme, re.S | re.M):
        command, _, answer = match.groups()
        path = re.search(r"localhost:8000(/\S+)", command).group(1)
        body = json.loads(re.search(r"-d '(.*?)'", command, re.S).group(1))
        found.append((command.splitlines()[0], path, body, answer))
    return found


def test_readme_has_one_v1_and_one_v2_example():
    paths = [path for _, path, _, _ in curl_examples()]
    assert paths == ["/v1/gradients", "/v2/models/blockgrad/infer"]
    first_line = curl_examples()[1][0]
    assert first_line.startswith("curl ") and "/v2/models/blockgrad/infer" in first_line


def test_readme_v1_example_answers_as_shown(client):
    [(_, path, body, answer)] = [example for example in curl_examples() if example[1] == "/v1/gradients"]
    response = client.post(path, json=body)
    assert response.status_code == 200
    got = response.get_json()
    shown = json.loads(answer.splitlines()[0].rstrip(",") + "}")  # the head: n, dim, factor, bounds, ...
    shown["accumulated"] = [json.loads(re.search(r'"accumulated":\[(\[[^\]]*\])', answer).group(1))]
    shown["losses"] = json.loads(re.search(r'"losses":(\[\[.*?\]\])', answer).group(1))
    for key in ("n", "dim", "factor", "bounds", "objective", "dtype"):
        assert got[key] == shown[key], key
    vectors = torch.tensor(body["vectors"], dtype=torch.float32)
    losses = [float(loss) for loss, _ in reference_blocks(vectors, shown["factor"], "sum")]
    assert [value for row in shown["losses"] for value in row] == pytest.approx(losses, rel=1e-6)
    assert [value for row in got["losses"] for value in row] == pytest.approx(losses, rel=1e-6)
    accumulated = reference_accumulated(vectors, shown["factor"], "sum")
    assert torch.equal(torch.tensor(got["accumulated"]), accumulated)
    assert shown["accumulated"] == [accumulated[0].tolist()]  # the one row shown


def test_readme_v2_example_answers_as_shown(client):
    [(_, path, body, answer)] = [example for example in curl_examples() if example[1].startswith("/v2/")]
    response = client.post(path, json=body)
    assert response.status_code == 200
    got, shown = response.get_json(), json.loads(answer)
    got["parameters"].pop("device"), shown["parameters"].pop("device")
    assert got == shown
    [vectors_input] = body["inputs"]
    vectors = torch.tensor(vectors_input["data"], dtype=torch.float32).reshape(vectors_input["shape"])
    factor = body["parameters"]["factor"]
    outputs = {output["name"]: output["data"] for output in shown["outputs"]}
    assert set(outputs) == {"accumulated", "losses"}
    assert outputs["accumulated"] == reference_accumulated(vectors, factor, "sum").flatten().tolist()
    assert outputs["losses"] == [float(loss) for loss, _ in reference_blocks(vectors, factor, "sum")]


def client_snippet() -> str:
    [snippet] = code_blocks(text(README), "python")
    return snippet


@pytest.mark.slow
def test_readme_client_snippet_prints_when_run_as_a_script():
    snippet = client_snippet()
    assert len(snippet.splitlines()) <= 5
    expected = re.search(r"# (.+)$", snippet.splitlines()[-1]).group(1)  # what the snippet says it prints
    with gunicorn_server(workers=1) as server:
        result = subprocess.run([sys.executable, "-c", snippet.replace("http://127.0.0.1:8000", server.url)],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "client")},
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_examples_are_run_with_the_virtual_environment():
    """A bare `python examples/...` fails without torch: every instruction names .venv's."""
    places = [README, *DOCS.glob("*.md"), *(ROOT / "examples").glob("*.py")]
    commands = [line for place in places for line in text(place).splitlines() if "examples/" in line
                and re.search(r"\bpython3? examples/|pip install \./client", line)]
    assert commands, "no example commands found"
    for line in commands:
        assert not re.search(r"(?<!\.venv/bin/)\bpython3? examples/", line), line
        assert not re.search(r"(?<!\.venv/bin/)\bpip install \./client", line), line


def dry_run(*variables: str) -> list[str]:
    """The commands `make` would run to build .venv's runtime, from scratch."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    env = {name: value for name, value in os.environ.items()
           if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_INDEX_URL")}
    result = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), ".venv/.runtime", *variables],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_cpu_torch_index_is_a_make_variable():
    plain = dry_run()
    assert plain and not any("index-url" in line for line in plain)
    url = "https://download.pytorch.org/whl/cpu"
    torch_first, *rest = dry_run(f"TORCH_INDEX_URL={url}")
    assert f"--index-url {url}" in torch_first and "torch==" in torch_first
    assert rest == plain  # then requirements.txt, as without the variable
    requirements = text(ROOT / "requirements.txt").splitlines()
    assert not [line for line in requirements if line.strip().startswith("-")]  # no index options in it


def test_the_export_examples_output_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "models/relnet.pt2"], timeout=30)
    assert result.returncode == 0


def test_docs_page_opens_on_its_operations(spec):
    """Every table of the description is folded inside <details>; what shows is a few lines."""
    description = spec["info"]["description"]
    depth, shown = 0, []
    for line in description.splitlines():
        depth += line.count("<details") - line.count("</details>")
        if line.startswith("|"):
            assert depth > 0, line
        elif depth == 0 and line.strip():
            shown.append(line)
    assert depth == 0
    assert description.count("<details") >= 3 and len(shown) <= 6, shown


def test_swagger_ui_v2_example_is_answered(client, spec):
    """What Swagger UI's Try it out sends for /v2 infer: each property's example."""
    content = spec["paths"]["/v2/models/{model}/infer"]["post"]["requestBody"]["content"]["application/json"]
    name = content["schema"]["$ref"].rsplit("/", 1)[1]
    schema = spec["components"]["schemas"][name]
    body = {key: prop["example"] for key, prop in schema["properties"].items() if "example" in prop}
    assert set(schema["required"]) <= set(body)
    response = client.post("/v2/models/blockgrad/infer", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    names = [output["name"] for output in response.get_json()["outputs"]]
    asked = [output["name"] for output in body.get("outputs", [])] or ["block_gradients", "accumulated", "bounds", "losses"]
    assert names == asked
