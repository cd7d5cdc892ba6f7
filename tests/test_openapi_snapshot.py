"""The public contract does not change by accident: /openapi.json equals the committed snapshot.

A deliberate change regenerates it with `python -m tools.openapi_snapshot` in its own commit.
"""
import subprocess
import sys
from pathlib import Path

from tools.openapi_snapshot import SNAPSHOT, render

ROOT = Path(__file__).resolve().parent.parent


def test_openapi_document_matches_the_snapshot():
    # A fresh process with no BLOCKGRAD_* variables: the same conditions the snapshot was made in.
    code = "from tools.openapi_snapshot import current_document, render; print(render(current_document()), end='')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == SNAPSHOT.read_text()


def test_snapshot_is_a_rendered_document():
    """The snapshot is what `render` writes (sorted keys), so a difference is in content, not layout."""
    import json
    assert render(json.loads(SNAPSHOT.read_text())) == SNAPSHOT.read_text()
