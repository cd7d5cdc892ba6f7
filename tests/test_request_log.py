"""One JSON log line per request, with the request id echoed; payloads never logged."""
import json
import logging
import re

import pytest

from app import create_app
from app.http.record import JsonFormatter

# Values that appear nowhere but in the payload, to prove it is not logged.
PAYLOAD = {"vectors": [[123.4567, 765.4321, 0.5], [31.4159, 27.1828, 1.25], [1.5, 2.5, 3.5]], "factor": 2,
           "outputs": ["accumulated", "losses"], "dtype": "float64"}
HEX32 = re.compile(r"[0-9a-f]{32}")


def request_lines(caplog) -> list[dict]:
    """Each request record as the JSON line the stderr handler writes."""
    formatter = JsonFormatter()
    return [json.loads(formatter.format(record)) for record in caplog.records if record.name == "blockgrad.request"]


def test_one_line_per_request_with_its_sizes_and_the_callers_id(client, caplog):
    caplog.set_level(logging.INFO, logger="blockgrad")
    response = client.post("/v1/gradients", json=PAYLOAD, headers={"X-Request-ID": "order-42.retry:1"})
    assert response.status_code == 200
    assert response.headers["X-Request-ID"] == "order-42.retry:1"
    [line] = request_lines(caplog)
    assert line["request_id"] == "order-42.retry:1"
    assert line["level"] == "info" and line["logger"] == "blockgrad.request"
    assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/gradients", 200)
    assert (line["n"], line["dim"], line["factor"]) == (3, 3, 2)
    assert line["outputs"] == ["accumulated", "losses"]
    assert line["output_numbers"] == 3 * 3 + 2 * 2
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
    assert isinstance(line["compute_ms"], float) and line["compute_ms"] >= 0
    assert isinstance(line["cpu_ms"], float) and line["cpu_ms"] >= 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    assert "error" not in line


def test_cpu_ms_is_the_serving_threads_cpu_time_not_its_wall_time(client, caplog, monkeypatch):
    """A request that waits 0.3 s logs a duration of at least that and little CPU; one that
    burns 0.2 s of its thread's CPU logs at least that, however slow the machine."""
    import time

    from app.core import run as core_run

    def waits(*args, **kwargs):
        time.sleep(0.3)
        return core_run.run(*args, **kwargs)

    def burns(*args, **kwargs):
        until = time.thread_time() + 0.2
        for _ in range(10**9):
            if time.thread_time() >= until:
                break
        return core_run.run(*args, **kwargs)

    caplog.set_level(logging.INFO, logger="blockgrad")
    for fake in (waits, burns):
        monkeypatch.setattr("app.http.pipeline.run", fake)
        assert client.post("/v1/gradients", json=PAYLOAD).status_code == 200
    waited, burned = request_lines(caplog)
    assert waited["duration_ms"] >= 300 and waited["cpu_ms"] < waited["duration_ms"] - 250
    assert burned["cpu_ms"] >= 200


def test_payload_is_never_logged(client, caplog):
    caplog.set_level(logging.DEBUG, logger="blockgrad")
    client.post("/v1/gradients", json=PAYLOAD)
    client.post("/v1/gradients", json=dict(PAYLOAD, factor=9))  # 422 names the field, not the values
    text = "\n".join(JsonFormatter().format(record) for record in caplog.records)
    assert len(request_lines(caplog)) == 2
    for number in ("123.4567", "765.4321", "31.4159", "27.1828"):
        assert number not in text


@pytest.mark.parametrize("header", [None, "", "x" * 129, "has space", "tab\there", "caf\u00e9", "quote\"", "<script>"])
def test_missing_or_unsafe_ids_are_replaced_by_a_fresh_one(client, caplog, header):
    caplog.set_level(logging.INFO, logger="blockgrad")
    headers = {} if header is None else {"X-Request-ID": header}
    response = client.get("/healthz", headers=headers)
    echoed = response.headers["X-Request-ID"]
    assert HEX32.fullmatch(echoed)
    [line] = request_lines(caplog)
    assert line["request_id"] == echoed
    assert (line["method"], line["route"], line["status"]) == ("GET", "/healthz", 200)
    assert "n" not in line  # no computation, no sizes


def test_ids_are_unique_and_the_longest_safe_id_is_kept(client):
    ids = {client.get("/healthz").headers["X-Request-ID"] for _ in range(20)}
    assert len(ids) == 20
    longest = "a" * 128
    assert client.get("/healthz", headers={"X-Request-ID": longest}).headers["X-Request-ID"] == longest


def test_errors_are_logged_with_their_code_and_echo_the_id(client, caplog):
    caplog.set_level(logging.INFO, logger="blockgrad")
    response = client.post("/v1/gradients", data="[", content_type="application/json",
                           headers={"X-Request-ID": "abc"})
    assert response.status_code == 400 and response.headers["X-Request-ID"] == "abc"
    assert client.get("/missing", headers={"X-Request-ID": "def"}).headers["X-Request-ID"] == "def"
    first, second = request_lines(caplog)
    assert (first["request_id"], first["status"], first["error"]) == ("abc", 400, "bad_json")
    assert (second["request_id"], second["route"], second["status"], second["error"]) == ("def", "unmatched", 404, "not_found")


def test_limit_refusal_logs_the_sizes_it_refused(caplog):
    app = create_app({"TESTING": True, "BLOCKGRAD_MAX_N": 2})
    caplog.set_level(logging.INFO, logger="blockgrad")
    response = app.test_client().post("/v1/gradients", json=PAYLOAD)
    assert response.status_code == 413
    [line] = request_lines(caplog)
    assert (line["n"], line["dim"], line["factor"], line["status"]) == (3, 3, 2, 413)
    assert line["error"] == "limit_exceeded" and line["output_numbers"] == 0


def test_internal_error_traceback_carries_the_request_id(caplog):
    app = create_app({"TESTING": True})

    @app.route("/boom")
    def boom():
        raise RuntimeError("secret internals")

    caplog.set_level(logging.INFO, logger="blockgrad")
    response = app.test_client().get("/boom", headers={"X-Request-ID": "trace-me"})
    assert response.status_code == 500 and b"secret" not in response.get_data()
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(record)) for record in caplog.records]
    [traceback_line] = [line for line in lines if "exc_info" in line]
    assert traceback_line["request_id"] == "trace-me"
    assert "RuntimeError: secret internals" in traceback_line["exc_info"]
    [line] = request_lines(caplog)
    assert (line["request_id"], line["status"], line["error"]) == ("trace-me", 500, "internal_error")


def test_protocol_requests_log_their_sizes_too(client, caplog):
    caplog.set_level(logging.INFO, logger="blockgrad")
    body = {"inputs": [{"name": "vectors", "datatype": "FP64", "shape": [4, 2], "data": list(range(8))}],
            "parameters": {"factor": 2}, "outputs": [{"name": "accumulated"}, {"name": "losses"}]}
    response = client.post("/v2/models/blockgrad/infer", json=body)
    assert response.status_code == 200
    response.get_data()  # JSON outputs are streamed: the line is written when the body ends
    [line] = request_lines(caplog)
    assert (line["route"], line["n"], line["dim"], line["factor"]) == ("/v2/models/<model>/infer", 4, 2, 2)
    assert line["outputs"] == ["accumulated", "losses"]
    assert line["output_numbers"] == 4 * 2 + 2 * 2


def json_handler():
    from app.http.record import JsonStderrHandler
    [handler] = [h for h in logging.getLogger("blockgrad").handlers if isinstance(h, JsonStderrHandler)]
    return handler


def test_the_line_written_without_logging_is_the_line_logging_writes(client, monkeypatch):
    """With the JSON handler the only listener (as under gunicorn) the line skips `logging`;
    with anything else listening it goes through `logging`: the same keys in the same order,
    the same values but the times."""
    import io

    from app.http import record as request_log

    handler = json_handler()
    monkeypatch.setattr(logging.root, "handlers", [])  # pytest's own capture handlers, away for this test
    monkeypatch.setattr(handler, "stream", io.StringIO())
    through_logging = []
    monkeypatch.setattr(request_log.request_log, "handle", through_logging.append)
    headers = {"X-Request-ID": "same-id"}
    assert client.post("/v1/gradients", json=PAYLOAD, headers=headers).status_code == 200
    assert through_logging == []  # written straight to the handler's stream
    [direct] = [json.loads(line) for line in handler.stream.getvalue().splitlines()]

    listener = logging.Handler()
    monkeypatch.setattr(logging.root, "handlers", [listener])
    assert request_log.sole_json_handler(request_log.request_log) is None
    assert client.post("/v1/gradients", json=PAYLOAD, headers=headers).status_code == 200
    [record] = through_logging
    via_logging = json.loads(JsonFormatter().format(record))
    assert list(direct) == list(via_logging)
    assert list(direct)[:5] == ["ts", "level", "logger", "message", "request_id"]
    timed = {"ts", "duration_ms", "cpu_ms", "compute_ms"}
    assert {k: v for k, v in direct.items() if k not in timed} == {k: v for k, v in via_logging.items() if k not in timed}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", direct["ts"])
    assert (direct["level"], direct["logger"], direct["message"], direct["n"]) == ("info", "blockgrad.request", "request", 3)


@pytest.mark.parametrize("change", ["logger filter", "handler filter", "logger level", "another handler"])
def test_anything_else_listening_sends_the_line_through_logging(monkeypatch, change):
    from app.http import record as request_log

    logger, handler = request_log.request_log, json_handler()
    monkeypatch.setattr(logging.root, "handlers", [])
    assert request_log.sole_json_handler(logger) is handler
    if change == "logger filter":
        monkeypatch.setattr(logger, "filters", [logging.Filter("x")])
    elif change == "handler filter":
        monkeypatch.setattr(handler, "filters", [logging.Filter("x")])
    elif change == "logger level":
        monkeypatch.setattr(logging.getLogger("blockgrad"), "level", logging.WARNING)
        logger.manager._clear_cache()
    else:
        monkeypatch.setattr(logger, "handlers", [logging.NullHandler()])
    try:
        assert request_log.sole_json_handler(logger) is None
    finally:
        monkeypatch.undo()
        logger.manager._clear_cache()
