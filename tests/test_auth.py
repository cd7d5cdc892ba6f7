"""BLOCKGRAD_API_TOKEN: bearer token on every route but the probes."""
import logging

import pytest

from app import create_app
from app.http.auth import OPEN_PATHS

from .test_api import GOOD, assert_error, strict_json

TOKEN = "s3cret-token-value"
GOOD_AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def locked():
    return create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": TOKEN}).test_client()


# /docs and /openapi.json are open unless BLOCKGRAD_DOCS_PUBLIC=false (tests/test_frictions.py).
PROTECTED = [("POST", "/v1/gradients"), ("GET", "/v1/gradients"),
             ("GET", "/v2"), ("GET", "/v2/models/blockgrad"), ("POST", "/v2/models/blockgrad/infer"),
             ("GET", "/no/such/route"), ("GET", "/healthz/extra")]
BAD_HEADERS = [None, "", "Bearer", "Bearer ", f"Basic {TOKEN}", "Bearer wrong", f"Bearer {TOKEN}x",
               f"Bearer {TOKEN[:-1]}", TOKEN, f"Token {TOKEN}"]


def assert_unauthorized(response, protocol=False):
    """401 with WWW-Authenticate; /v2 answers in the protocol's {"error": "<message>"} form."""
    if protocol:
        assert response.status_code == 401
        assert isinstance(strict_json(response.get_data())["error"], str)
    else:
        assert assert_error(response, 401, "unauthorized")["details"] == {}
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert TOKEN not in response.get_data(as_text=True)


@pytest.mark.parametrize("method,path", PROTECTED)
def test_protected_routes_need_the_token(locked, method, path):
    protocol = path.startswith("/v2")
    assert_unauthorized(locked.open(path, method=method, json=GOOD), protocol)
    assert_unauthorized(locked.open(path, method=method, json=GOOD, headers={"Authorization": "Bearer wrong"}),
                        protocol)


@pytest.mark.parametrize("header", BAD_HEADERS)
def test_bad_authorization_headers(locked, header):
    headers = {"Authorization": header} if header is not None else {}
    assert_unauthorized(locked.post("/v1/gradients", json=GOOD, headers=headers))


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_right_token_passes(locked, scheme):
    response = locked.post("/v1/gradients", json=GOOD, headers={"Authorization": f"{scheme} {TOKEN}"})
    assert response.status_code == 200 and strict_json(response.get_data())["n"] == 3
    assert locked.get("/openapi.json", headers=GOOD_AUTH).status_code == 200
    assert_error(locked.get("/nowhere", headers=GOOD_AUTH), 404, "not_found")


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_stay_open(locked, path):
    assert locked.get(path).status_code == 200


def test_open_paths_are_exactly_the_probes():
    assert OPEN_PATHS == {"/healthz", "/readyz", "/metrics"}
    from app.http.auth import is_open
    assert is_open("/v2/health/live") and is_open("/v2/health/ready")
    assert not is_open("/v2") and not is_open("/v2/models/blockgrad") and not is_open("/v2/healthz")


def test_no_token_means_open(client):
    assert client.post("/v1/gradients", json=GOOD).status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_blank_token_means_open():
    client = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": "  "}).test_client()
    assert client.post("/v1/gradients", json=GOOD).status_code == 200


def test_the_token_is_never_logged(locked, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    locked.post("/v1/gradients", json=GOOD, headers={"Authorization": "Bearer wrong"})
    locked.post("/v1/gradients", json=GOOD, headers=GOOD_AUTH)

    def explode(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr("app.http.pipeline.run", explode)
    assert_error(locked.post("/v1/gradients", json=GOOD, headers=GOOD_AUTH), 500, "internal_error")
    assert "boom" in caplog.text and TOKEN not in caplog.text


def test_comparison_is_constant_time(monkeypatch):
    """The check goes through hmac.compare_digest, not ==."""
    import app.http.auth as auth
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    client = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": TOKEN}).test_client()
    assert client.post("/v1/gradients", json=GOOD, headers=GOOD_AUTH).status_code == 200
    assert seen == [(TOKEN.encode(), TOKEN.encode())]


def test_a_non_ascii_token_works_as_utf8_bytes():
    locked = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": "clé-ü"}).test_client()
    wire = "Bearer " + "clé-ü".encode("utf-8").decode("latin-1")  # what a WSGI server hands over
    assert locked.post("/v1/gradients", json=GOOD, headers={"Authorization": wire}).status_code == 200
    assert_unauthorized(locked.post("/v1/gradients", json=GOOD, headers={"Authorization": "Bearer cle-u"}))
