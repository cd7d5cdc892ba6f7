"""Fails a test that starts a server or a cluster without the `slow` marker.

`-m "not slow"` must leave out every test that starts gunicorn or Dask (docs/testing.md).
Hand marks drift, so this plugin (registered by conftest.py) watches the process launches
themselves: a gunicorn, the embedded cluster's supervisor or a Dask scheduler/worker started
while an unmarked test runs (setup, call or teardown) fails that test, and so does an
unmarked test that asks for a fixture that starts one. The process still starts, so the
test's own clean-up runs as usual.
"""
import os
import subprocess

import pytest

# Fixtures that start a server or a cluster (conftest.py), by name.
SERVER_FIXTURES = {"cluster", "served"}
PROGRAMS = ("gunicorn", "dask-scheduler", "dask-worker")  # argv[0]'s name
MODULES = ("gunicorn", "app.jobs.supervisor", "distributed.cli")  # python -m ...

_current = None  # the item being run, while it is unmarked
_seen: dict[str, list[str]] = {}  # nodeid -> launches seen while it ran unmarked


def _launch(args) -> str | None:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.fsdecode(a) for a in argv]
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else ""
    if (words and os.path.basename(words[0]).startswith(PROGRAMS) or module.startswith(MODULES)
            or words[:1] == ["make"] and "serve" in words):
        return " ".join(words)[:200]
    return None


_execute_child = subprocess.Popen._execute_child


def _watched_execute_child(self, args, *rest, **kwargs):
    if _current is not None:
        launch = _launch(args)
        if launch is not None:
            _seen.setdefault(_current.nodeid, []).append(launch)
    return _execute_child(self, args, *rest, **kwargs)


subprocess.Popen._execute_child = _watched_execute_child


def _unmarked(item) -> bool:
    return item.get_closest_marker("slow") is None


def _from_conftest(item, name: str) -> bool:
    """`name` is one of conftest.py's fixtures for this item (a module may define its own)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    return bool(defs) and getattr(defs[-1].func, "__module__", "").endswith("conftest")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _current
    _current = item if _unmarked(item) else None
    if _current is not None:
        uses = [name for name in SERVER_FIXTURES if _from_conftest(item, name)]
        if uses:
            pytest.fail(f"uses {sorted(uses)}, which start a server or a cluster, without @pytest.mark.slow",
                        pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    launches = _seen.pop(item.nodeid, None)
    if launches and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = ("started a server or a cluster without @pytest.mark.slow (tests/_guard.py): "
                           + "; ".join(launches))
    if call.when == "teardown":
        global _current
        _current = None
