"""Schema fuzzing: schemathesis generates requests from /openapi.json and runs all
of its default checks (no 5xx, responses match the documented schemas, status codes
and content types are documented, invalid data is refused, ...) against the WSGI app
directly, without a server. Every /v1/gradients answer to a JSON object is also held to the
oracle (tests/oracle.py): the exact answer, or the refusal it demands, not merely a
documented status."""
import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from app import create_app

from .oracle import assert_answer

# Some rules of a valid request are beyond JSON Schema: rows of equal length, factor <= N,
# values that fit the chosen dtype, results that stay finite, and the size limits. A
# schema-valid body that breaks one of them is rightly a 422 or a 413, so positive data
# may get those as well as a 2xx; every other check runs as schemathesis ships it. The
# Open Inference Protocol answers every invalid request with 400 instead of 422.
CONFIG = SchemathesisConfig.from_dict({
    "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "413", "422"]}},
    "operations": [{"include-path-regex": "^/v2/", "checks": {
        "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "413"]}}},
        # This app has no Dask cluster: jobs are accepted and stay queued (503 overloaded past
        # BLOCKGRAD_MAX_JOBS), job routes answer 404 for an id no job has.
        {"include-path-regex": "^/v1/jobs", "checks": {
            "positive_data_acceptance": {"expected-statuses": ["2xx", "404", "413", "422", "503"]},
            "not_a_server_error": {"enabled": False}}}],
})

# Its job store in a directory of its own (never ./data): POSTed jobs stay queued, no cluster runs them.
STORE = tempfile.mkdtemp(prefix="blockgrad-fuzz-")
atexit.register(shutil.rmtree, STORE, True)
schema = schemathesis.openapi.from_wsgi("/openapi.json", create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": STORE}),
                                        config=CONFIG)


@dataclass(frozen=True)
class Answer:
    """What tests/oracle.py reads of a response."""
    status_code: int
    content: bytes

    def get_data(self) -> bytes:
        return self.content


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case):
    response = case.call_and_validate()
    sent = response.request
    if (sent.method, case.path) == ("POST", "/v1/gradients") and isinstance(case.body, dict) \
            and sent.headers.get("Content-Type") == "application/json" and json.loads(sent.body) == case.body:
        assert_answer(case.body, Answer(response.status_code, response.content))
