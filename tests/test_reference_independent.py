"""tools/reference.py, the oracle, shares nothing with the code it checks: it imports torch
and nothing else, anywhere in the file (function bodies included), and loads no module by name."""
import ast
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parent.parent / "tools" / "reference.py"


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names, at any depth, and any module loaded by name."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in {"__import__", "import_module", "run_path", "run_module", "exec", "eval"}:
                modules.add(f"<dynamic {name}>")
    return modules


def test_the_reference_imports_only_torch():
    modules = imported_modules(REFERENCE.read_text())
    assert modules == {"torch"}, modules
    assert not any(m == "app" or m.startswith(("app.", ".")) for m in modules)


@pytest.mark.parametrize("source, found", [
    ("import torch\nfrom app.core import engine\n", {"torch", "app.core"}),
    ("import torch\ndef f():\n    from app.core.objectives import OBJECTIVES\n", {"torch", "app.core.objectives"}),
    ("class A:\n    def m(self):\n        import app\n", {"app"}),
    ("def f():\n    from . import x\n", {"."}),
    ("import importlib\ndef f():\n    return importlib.import_module('app')\n", {"importlib", "<dynamic import_module>"}),
    ("def f():\n    return __import__('app')\n", {"<dynamic __import__>"}),
])
def test_the_check_sees_imports_anywhere(source, found):
    assert imported_modules(source) == found
