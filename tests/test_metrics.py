"""/metrics through the Flask test client (one process, the default registry).

The registry is shared by every app a test creates, so each test compares a
scrape before and after its own requests.
"""
import pytest
from prometheus_client.parser import text_string_to_metric_families

GOOD = {"vectors": [[0.5, 1.0, 1.5], [2.0, 2.5, 3.0], [3.5, 4.0, 4.5], [5.0, 5.5, 6.0]], "factor": 2,
        "outputs": ["blocks", "accumulated", "losses"]}
GOOD_NUMBERS = 4 * 4 * 2 * 3 + 4 * 3 + 2 * 2  # blocks N*N*2D + accumulated N*D + losses F*F = 112
# An answer over WHOLE_ANSWER_NUMBERS (8192): its blocks stream.
STREAMED = dict(GOOD, vectors=[[0.5 * i, 1.0, 1.5] for i in range(64)])
STREAMED_NUMBERS = 64 * 64 * 2 * 3 + 64 * 3 + 2 * 2  # 24772


def scrape(client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type == "text/plain; version=0.0.4; charset=utf-8"
    samples = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests_count(samples, route, method, status) -> float:
    return value(samples, "blockgrad_requests_total", route=route, method=method, status=str(status))


def test_gradients_request_moves_every_counter(client):
    before = scrape(client)
    response = client.post("/v1/gradients", json=GOOD)
    assert response.status_code == 200 and len(response.get_json()["blocks"]) == 4
    after = scrape(client)
    assert requests_count(after, "/v1/gradients", "POST", 200) == requests_count(before, "/v1/gradients", "POST", 200) + 1
    duration = "blockgrad_request_duration_seconds"
    assert value(after, f"{duration}_count", route="/v1/gradients") == value(before, f"{duration}_count", route="/v1/gradients") + 1
    assert value(after, f"{duration}_bucket", route="/v1/gradients", le="+Inf") == value(after, f"{duration}_count", route="/v1/gradients")
    assert value(after, f"{duration}_sum", route="/v1/gradients") > value(before, f"{duration}_sum", route="/v1/gradients")
    assert value(after, "blockgrad_output_numbers_total") == value(before, "blockgrad_output_numbers_total") + GOOD_NUMBERS
    assert value(after, "blockgrad_compute_seconds_total") > value(before, "blockgrad_compute_seconds_total")
    assert value(after, "blockgrad_device_info", device="cpu") == 1.0
    # the scrape's own /metrics request was counted by the time of the next scrape
    assert requests_count(after, "/metrics", "GET", 200) == requests_count(before, "/metrics", "GET", 200) + 1


@pytest.mark.parametrize("method,path,kwargs,route,status,code", [
    ("get", "/no/such/thing", {}, "unmatched", 404, "not_found"),
    ("post", "/healthz", {}, "unmatched", 405, "method_not_allowed"),
    ("post", "/v1/gradients", {"data": "x", "content_type": "text/plain"}, "/v1/gradients", 415, "unsupported_media_type"),
    ("post", "/v1/gradients", {"json": {"vectors": [[1.0]], "factor": 2}}, "/v1/gradients", 422, "validation_error"),
    ("post", "/v1/gradients", {"json": {"vectors": [[1.0] * 2] * 3, "factor": 1, "dtype": "float32",
                                        "objective": "sum_of_squares"}}, "/v1/gradients", 200, None),
])
def test_errors_are_counted_by_code_and_route_is_the_rule(client, method, path, kwargs, route, status, code):
    before = scrape(client)
    response = getattr(client, method)(path, **kwargs)
    response.get_data()  # a streamed 200 ends (and is counted) when its body is read
    assert response.status_code == status
    after = scrape(client)
    assert requests_count(after, route, method.upper(), status) == requests_count(before, route, method.upper(), status) + 1
    if status == 404:  # an unknown path never becomes a label value
        assert not any(dict(labels).get("route") == path for _, labels in after)
    if code:
        assert value(after, "blockgrad_errors_total", code=code) == value(before, "blockgrad_errors_total", code=code) + 1
    failed = sum(v for (name, _), v in after.items() if name == "blockgrad_errors_total")
    assert failed == sum(v for (name, _), v in before.items() if name == "blockgrad_errors_total") + (1 if code else 0)


def test_route_label_is_the_url_rule_not_the_path(client):
    before = scrape(client)
    assert client.get("/docs/assets/swagger-ui.css").status_code == 200
    assert client.get("/docs/assets/index.css").status_code == 200
    after = scrape(client)
    rule = "/docs/assets/<path:filename>"
    assert requests_count(after, rule, "GET", 200) == requests_count(before, rule, "GET", 200) + 2


def test_unknown_methods_do_not_grow_labels(client):
    before = scrape(client)
    client.open("/healthz", method="BREW")
    after = scrape(client)
    assert requests_count(after, "unmatched", "other", 405) == requests_count(before, "unmatched", "other", 405) + 1


def test_streamed_answer_is_counted_when_its_body_ends(client):
    """While the blocks stream, the request is in flight and its outputs are not counted yet."""
    before = scrape(client)
    assert value(before, "blockgrad_requests_in_flight") >= 1.0  # the scrape itself
    response = client.post("/v1/gradients", json=STREAMED, buffered=False)
    assert response.status_code == 200 and response.is_streamed
    during = scrape(client)
    assert value(during, "blockgrad_requests_in_flight") == value(before, "blockgrad_requests_in_flight") + 1
    assert value(during, "blockgrad_output_numbers_total") == value(before, "blockgrad_output_numbers_total")
    assert requests_count(during, "/v1/gradients", "POST", 200) == requests_count(before, "/v1/gradients", "POST", 200)
    body = response.get_json()
    assert len(body["blocks"]) == 4
    after = scrape(client)
    assert value(after, "blockgrad_requests_in_flight") == value(before, "blockgrad_requests_in_flight")
    assert value(after, "blockgrad_output_numbers_total") == value(before, "blockgrad_output_numbers_total") + STREAMED_NUMBERS
    assert requests_count(after, "/v1/gradients", "POST", 200) == requests_count(before, "/v1/gradients", "POST", 200) + 1


def test_stream_closed_early_counts_no_outputs_and_a_client_closed_error(client):
    before = scrape(client)
    response = client.post("/v1/gradients", json=STREAMED, buffered=False)
    response.close()  # as a server does when the client goes away mid-body
    after = scrape(client)
    assert value(after, "blockgrad_requests_in_flight") == value(before, "blockgrad_requests_in_flight")
    assert value(after, "blockgrad_output_numbers_total") == value(before, "blockgrad_output_numbers_total")
    assert value(after, "blockgrad_errors_total", code="client_closed") == value(before, "blockgrad_errors_total", code="client_closed") + 1


def test_readyz_reports_the_device(client):
    assert client.get("/readyz").status_code == 200
    assert value(scrape(client), "blockgrad_device_info", device="cpu") == 1.0


def test_failed_computation_counts_its_compute_time_but_no_outputs(client):
    before = scrape(client)
    response = client.post("/v1/gradients", json={"vectors": [[1e30, 1e30], [1e30, 1e30]],
                                                  "objective": "sum_of_squares", "factor": 1})
    assert response.status_code == 422 and response.get_json()["error"]["code"] == "non_finite_result"
    after = scrape(client)
    assert value(after, "blockgrad_compute_seconds_total") > value(before, "blockgrad_compute_seconds_total")
    assert value(after, "blockgrad_output_numbers_total") == value(before, "blockgrad_output_numbers_total")
    assert value(after, "blockgrad_errors_total", code="non_finite_result") == value(before, "blockgrad_errors_total", code="non_finite_result") + 1
