"""Tests of the tests: a broken service makes the suite fail.

Each case runs a small part of the suite in a fresh pytest with a sabotage plugin
(tests/_sabotage_*.py, loaded with `-p` before the app is imported) and expects pytest's
exit status 1 and the named tests among the failures. The same tests pass in the suite
itself, so their failure here is the sabotage's doing.
"""
import re
import subprocess
import sys

import pytest

from tools.server import ROOT

pytestmark = pytest.mark.slow  # three pytest runs, one of them starting the service as `make serve` does

CASES = {
    # 422 non_finite_result for every request, before computing.
    "refuse_all": (
        ["tests/test_api.py::test_seed_example_end_to_end", "tests/test_api.py::test_api_matches_reference",
         "tests/test_v2.py::test_seed_example_defaults", "tests/test_properties.py"],
        ["tests/test_api.py::test_seed_example_end_to_end", "tests/test_api.py::test_api_matches_reference",
         "tests/test_v2.py::test_seed_example_defaults",
         "tests/test_properties.py::test_any_request_gets_the_answer_the_oracle_demands",
         "tests/test_properties.py::test_valid_requests_are_answered_exactly_or_refused_only_where_they_overflow"]),
    # 500 internal_error for {"vectors": [[]]}, in process and from tools/server.py's gunicorn.
    "empty_row": (
        ["tests/test_api.py::test_bad_fields", "tests/test_contract.py::test_empty_rows_are_422_not_500"],
        ["tests/test_api.py::test_bad_fields[body3-vectors]", "tests/test_contract.py::test_empty_rows_are_422_not_500"]),
    # The engine's last block of every band left out (a one-band answer's last block).
    "drop_last_block": (
        ["tests/test_engine.py::test_seed_example_values", "tests/test_engine.py::test_engine_matches_seed_loops",
         "tests/test_api.py::test_seed_example_end_to_end", "tests/test_v2.py::test_json_infer_matches_reference"],
        ["tests/test_engine.py::test_seed_example_values", "tests/test_engine.py::test_engine_matches_seed_loops",
         "tests/test_api.py::test_seed_example_end_to_end", "tests/test_v2.py::test_json_infer_matches_reference"]),
}


def failed_tests(output: str) -> set[str]:
    return set(re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE))


@pytest.mark.parametrize("sabotage", sorted(CASES))
def test_the_suite_fails_on_a_broken_service(sabotage):
    subset, must_fail = CASES[sabotage]
    try:  # under pytest.ini's 600 s, so that a hang shows the sub-run's output, not a SIGALRM
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", f"tests._sabotage_{sabotage}", "-p", "no:cacheprovider",
             "-q", "-rf", *subset], cwd=ROOT, capture_output=True, text=True, timeout=500)
    except subprocess.TimeoutExpired as hung:
        shown = [part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                 for part in (hung.stdout, hung.stderr)]
        pytest.fail("the sub-run hung past 500 s:\n" + "".join(shown)[-3000:])
    output = done.stdout + done.stderr
    failed = failed_tests(output)
    assert done.returncode == 1, output[-3000:]
    for name in must_fail:  # a test id, or a function whose every parametrization is counted
        assert name in failed or any(f.startswith(name + "[") for f in failed), (name, sorted(failed))
