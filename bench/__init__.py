"""blockgrad's benchmark: `make bench` (python -m bench) prints one table of ratios.

Not part of the test suite. Every row is one function returning Results, so a
row can be added without touching the others (see ROWS in bench/__main__.py).
"""
import sys
from pathlib import Path

# blockgrad_client from its source in client/, as pytest.ini's `pythonpath` gives the tests.
CLIENT_SOURCE = str(Path(__file__).resolve().parent.parent / "client")
if CLIENT_SOURCE not in sys.path:
    sys.path.insert(0, CLIENT_SOURCE)
