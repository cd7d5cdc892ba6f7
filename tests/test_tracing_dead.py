"""Traces to a collector that is down (a port nobody listens on): every request is answered as
without tracing, and the service keeps serving; with no OTLP endpoint set (the session's
`served`), a traceparent changes nothing and the log line carries no trace ids. Counts and
statuses, never times."""
import json
import secrets

import pytest
import requests

from tools.server import free_port, gunicorn_server, wait_until

pytestmark = pytest.mark.slow
WAIT_S = 120
BODY = {"vectors": [[0.5, 1.0], [1.5, -2.0], [3.0, 0.25], [-1.0, 2.0]], "factor": 2}


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def request_lines(server) -> list[dict]:
    return [line for line in map(json.loads, (text for text in server.log().splitlines() if text.startswith('{"ts"')))
            if line.get("message") == "request" and line.get("route") == "/v1/gradients"]


def test_a_dead_collector_leaves_every_request_answered():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}", "OTEL_BSP_SCHEDULE_DELAY": "10",
           "OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    with gunicorn_server(workers=1, env=env) as server, requests.Session() as session:
        statuses = [session.post(server.url + "/v1/gradients", json=BODY, headers={"traceparent": traceparent()},
                                 timeout=WAIT_S).status_code for _ in range(40)]
        assert statuses == [200] * 40
        assert wait_until(lambda: len(request_lines(server)) == 40, WAIT_S), len(request_lines(server))
        assert all("trace_id" in line for line in request_lines(server))  # traced all along
        assert session.get(server.url + "/readyz", timeout=WAIT_S).status_code == 200


def test_off_a_traceparent_changes_nothing(served):
    answer = requests.post(served.url + "/v1/gradients", json=BODY, headers={"traceparent": traceparent()},
                           timeout=WAIT_S)
    assert answer.status_code == 200
    request_id = answer.headers["X-Request-ID"]
    found = []
    assert wait_until(lambda: found.extend(line for line in request_lines(served)
                                           if line["request_id"] == request_id) or found, WAIT_S)
    assert "trace_id" not in found[0] and "span_id" not in found[0]
