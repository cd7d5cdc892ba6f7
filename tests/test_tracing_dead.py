"""Traces to a collector that never answers (it takes the connection, never the request): every
request is answered as without tracing, the service keeps serving, and the spans its full queue
drops are counted in /metrics; with no OTLP endpoint set (the session's `served`), a traceparent
changes nothing and the log line carries no trace ids. Counts and statuses, never times."""
import json
import re
import secrets
import socket

import pytest
import requests

from tools.server import gunicorn_server, wait_until

pytestmark = pytest.mark.slow
WAIT_S = 120
BODY = {"vectors": [[0.5, 1.0], [1.5, -2.0], [3.0, 0.25], [-1.0, 2.0]], "factor": 2}


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def request_lines(server) -> list[dict]:
    return [line for line in map(json.loads, (text for text in server.log().splitlines() if text.startswith('{"ts"')))
            if line.get("message") == "request" and line.get("route") == "/v1/gradients"]


def dropped(metrics_text: str) -> float:
    [value] = re.findall(r"^blockgrad_trace_spans_dropped_total (\S+)$", metrics_text, re.M)
    return float(value)


def test_a_collector_that_never_answers_leaves_every_request_answered_and_drops_are_counted():
    """The first batch of 4 spans is exported to a collector whose listen backlog takes the
    connection and never the request: the export thread waits on it (for longer than the
    test), 4 spans fill the queue, every later span is dropped: of 40 requests' 5 spans each
    (server, decode, admit, compute, render), at least 200 - 8 are counted."""
    collector = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepted
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.getsockname()[1]}",
           "OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "600"}
    with collector, gunicorn_server(workers=1, env=env) as server, requests.Session() as session:
        statuses = [session.post(server.url + "/v1/gradients", json=BODY, headers={"traceparent": traceparent()},
                                 timeout=WAIT_S).status_code for _ in range(40)]
        assert statuses == [200] * 40
        assert wait_until(lambda: len(request_lines(server)) == 40, WAIT_S), len(request_lines(server))
        assert all("trace_id" in line for line in request_lines(server))  # traced all along
        assert session.get(server.url + "/readyz", timeout=WAIT_S).status_code == 200
        assert dropped(session.get(server.url + "/metrics", timeout=WAIT_S).text) >= 40 * 5 - 8


def test_off_a_traceparent_changes_nothing(served):
    answer = requests.post(served.url + "/v1/gradients", json=BODY, headers={"traceparent": traceparent()},
                           timeout=WAIT_S)
    assert answer.status_code == 200
    request_id = answer.headers["X-Request-ID"]
    found = []
    assert wait_until(lambda: found.extend(line for line in request_lines(served)
                                           if line["request_id"] == request_id) or found, WAIT_S)
    assert "trace_id" not in found[0] and "span_id" not in found[0]
