"""Write the service's OpenAPI document to tests/data/openapi.json (the contract snapshot).

Run from the repository root: `python -m tools.openapi_snapshot`. The document is made with
the default settings (no BLOCKGRAD_* variables) so that it does not depend on the machine.
"""
import json
import os
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parent.parent / "tests" / "data" / "openapi.json"


def current_document() -> dict:
    for name in [name for name in os.environ if name.startswith("BLOCKGRAD_")]:
        del os.environ[name]
    from app import create_app

    return create_app({"TESTING": True}).test_client().get("/openapi.json").get_json()


def render(document: dict) -> str:
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    SNAPSHOT.write_text(render(current_document()))
    print(f"wrote {SNAPSHOT}")
