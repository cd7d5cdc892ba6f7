"""The layout's rules, read from the source: the core is pure, the HTTP glue knows no front end,
front ends are independent, no module imports another in a loop, and gunicorn's master loads
neither torch nor Flask. Every import counts, those inside functions and `if` blocks too."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEB_OR_SERIALISATION = {"flask", "werkzeug", "marshmallow", "flask_smorest", "webargs", "apispec", "orjson",
                        "prometheus_client", "gunicorn", "requests", "grpc", "grpc_health", "google", "tritonclient",
                        "opentelemetry"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports, anywhere in it (function bodies included)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return all_imports_of(path, package)


def all_imports_of(path: Path, package: str) -> set[str]:
    """`package`: the one relative imports start from."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # submodules imported by name
    return names


MODULES = {module_name(p): p for p in (ROOT / "app").rglob("*.py")}
IMPORTS = {name: {i for i in all_imports(path) if i in MODULES} | {
    i.split(".")[0] for i in all_imports(path) if not i.startswith("app")} for name, path in MODULES.items()}


def test_core_imports_only_itself_and_no_web_library():
    for name, imported in IMPORTS.items():
        if name.startswith("app.core"):
            outside = {i for i in imported if i.startswith("app") and not i.startswith("app.core")}
            assert not outside, f"{name} imports {outside}"
            assert not imported & WEB_OR_SERIALISATION, f"{name} imports {imported & WEB_OR_SERIALISATION}"


def test_http_glue_imports_no_front_end():
    """app/http is what the front ends plug into: the app factory (app/__init__.py) wires them."""
    for name, imported in IMPORTS.items():
        if name.startswith("app.http"):
            assert not {i for i in imported if i.startswith("app.api")}, f"{name} imports a front end"


def test_only_the_job_routes_and_the_factory_import_the_jobs():
    """app/jobs is the Dask side, below the web: the HTTP glue, Services and the other front ends
    (health's cluster report included) reach it through Services; app/jobs imports no web layer."""
    users = {"app", "app.api.v1.jobs", "app.api.v1.job_schemas", "app.serving.hooks"}
    for name, imported in IMPORTS.items():
        if name.startswith("app.jobs"):
            web = {i for i in imported if i.startswith(("app.http", "app.api", "app.extensions", "app.serving"))}
            assert not web, f"{name} imports {web}"
        elif name not in users:
            assert not {i for i in imported if i.startswith("app.jobs")}, f"{name} imports app.jobs"


def test_imports_are_read_inside_functions_too(tmp_path):
    """The reader sees an import that only a function body makes (so the rules above can fail)."""
    source = tmp_path / "probe.py"
    source.write_text("def build():\n    from app.api import register_front_ends\n")
    assert "app.api" in all_imports_of(source, "app.http")


def test_front_ends_do_not_import_each_other():
    for name, imported in IMPORTS.items():
        for own, other in (("app.api.v1", "app.api.v2"), ("app.api.v2", "app.api.v1")):
            if name.startswith(own):
                assert not {i for i in imported if i.startswith(other)}, f"{name} imports {other}"


def test_no_import_cycles():
    graph = {name: {i for i in imported if i in MODULES and i != name} for name, imported in IMPORTS.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_gunicorn_config_loads_neither_torch_nor_flask():
    code = ("import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
            "print(sorted(m for m in ('torch', 'flask', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
