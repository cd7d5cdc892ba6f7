"""What a newcomer tripped over (issue 13), each pinned: errors that say what exists, the
truth about /v2 datatypes, /docs/ and the docs with a token, one control socket per instance,
and an OpenAPI document that refuses what the service refuses."""
import os
import stat
import tempfile
import time
from urllib.parse import urljoin, urlsplit

import numpy as np
import pytest
from openapi_schema_validator import OAS30Validator

from app import create_app
from app.http.settings import Settings
from tools.server import gunicorn_server

from .test_api import assert_error, strict_json
from .test_docs import AssetLinks

TOKEN = "friction-token"
V1_FIELDS = ["vectors", "factor", "objective", "offset", "outputs", "dtype"]  # docs/api.md's /v1 table


def rules_as_routes(app) -> set[str]:
    return {f"{method} {rule.rule}" for rule in app.url_map.iter_rules()
            if rule.endpoint != "static" and not rule.rule.startswith("/docs/")
            for method in rule.methods - {"HEAD", "OPTIONS"}}


def test_404_names_the_routes_that_exist(app, client):
    error = assert_error(client.get("/v1/gradient"), 404, "not_found")
    assert set(error["details"]["routes"]) == rules_as_routes(app)
    for route in ("POST /v1/gradients", "GET /healthz", "GET /docs", "POST /v2/models/<model>/infer"):
        assert route in error["message"]
    assert "/v1/gradient;" in error["message"] and "spelling" not in error["message"]
    response = client.get("/v2/modells/blockgrad")  # /v2: the protocol's body, the code in the header
    assert response.status_code == 404 and response.headers["X-Blockgrad-Error-Code"] == "not_found"
    assert "POST /v2/models/<model>/infer" in strict_json(response.get_data())["error"]


@pytest.mark.parametrize("method,path,allowed", [("get", "/v1/gradients", "POST"), ("delete", "/healthz", "GET"),
                                                 ("put", "/v2/models/blockgrad/infer", "POST")])
def test_405_names_the_methods_the_route_takes(client, method, path, allowed):
    response = getattr(client, method)(path)
    assert response.status_code == 405 and response.headers["X-Blockgrad-Error-Code"] == "method_not_allowed"
    body = strict_json(response.get_data())
    message = body["error"] if path.startswith("/v2") else body["error"]["message"]
    assert f"send {allowed}" in message and method.upper() in message and path in message
    if not path.startswith("/v2"):
        assert set(body["error"]["details"]["allowed"]) == set(response.headers["Allow"].split(", "))


def test_an_unknown_field_names_the_fields_that_exist(client):
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]], "factr": 1}), 422, "validation_error")
    [message] = error["details"]["fields"]["factr"]
    assert all(name in message for name in V1_FIELDS), message


@pytest.mark.parametrize("request_kwargs,status,code", [
    (dict(method="POST", path="/v1/gradients", data="{", content_type="application/json"), 400, "bad_json"),
    (dict(method="POST", path="/v1/gradients", json={"vectors": [[1.0]]}, headers={}), 401, "unauthorized"),
    (dict(method="GET", path="/nowhere"), 404, "not_found"),
    (dict(method="GET", path="/v1/gradients"), 405, "method_not_allowed"),
    (dict(method="POST", path="/v1/gradients", json={"vectors": [[1.0] * 50] * 50}), 413, "too_large"),
    (dict(method="POST", path="/v1/gradients", data="x", content_type="text/plain"), 415, "unsupported_media_type"),
])
def test_every_error_has_details(request_kwargs, status, code):
    locked = create_app({"TESTING": True, "BLOCKGRAD_MAX_BODY_BYTES": 1000, "BLOCKGRAD_API_TOKEN": TOKEN})
    kwargs = {"headers": {"Authorization": f"Bearer {TOKEN}"}, **request_kwargs}
    error = assert_error(locked.test_client().open(**kwargs), status, code)
    assert isinstance(error["details"], dict)


def test_too_large_gives_the_limit():
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_BODY_BYTES": 1000}).test_client()
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0] * 50] * 50}), 413, "too_large")
    assert "1000 bytes" in error["message"]
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_BODY_BYTES", "allowed": 1000}
    response = client.post("/v2/models/blockgrad/infer", json={"inputs": [{"data": [1.0] * 500}]})
    assert response.status_code == 413 and "1000 bytes" in strict_json(response.get_data())["error"]


def test_v2_metadata_lists_every_datatype_it_takes(client):
    metadata = strict_json(client.get("/v2/models/blockgrad").get_data())
    [vectors] = metadata["inputs"]
    assert vectors["datatype"] == "FP32" and vectors["datatypes"] == ["FP32", "FP64"]
    for datatype in vectors["datatypes"]:  # what it says is true: each is taken, and the outputs follow it
        document = {"inputs": [{"name": "vectors", "shape": [2, 1], "datatype": datatype, "data": [1.0, 2.0]}],
                    "outputs": [{"name": "accumulated"}]}
        answer = strict_json(client.post("/v2/models/blockgrad/infer", json=document).get_data())
        assert answer["outputs"][0]["datatype"] == datatype
    outputs = {o["name"]: o["datatypes"] for o in metadata["outputs"]}
    assert outputs == {"block_gradients": ["FP32", "FP64"], "accumulated": ["FP32", "FP64"],
                       "bounds": ["INT64"], "losses": ["FP32", "FP64"]}


def test_docs_with_a_trailing_slash_is_the_page_itself(client):
    response = client.get("/docs/", headers={"Host": "evil.example"})
    assert response.status_code == 200 and response.mimetype == "text/html" and "Location" not in response.headers
    page = response.get_data(as_text=True)
    assert page == client.get("/docs").get_data(as_text=True) and "evil" not in page
    parser = AssetLinks()
    parser.feed(page)
    assert parser.urls
    for url in parser.urls:  # the page's assets resolve from /docs/ as from /docs
        path = urlsplit(urljoin("http://localhost/docs/", url)).path
        asset = client.get(path)
        assert asset.status_code == 200, path
        asset.close()


DOCS = ["/docs", "/docs/", "/docs/assets/swagger-ui.css", "/openapi.json"]


@pytest.mark.parametrize("path", DOCS)
def test_docs_are_open_with_a_token_unless_closed(path):
    open_docs = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": TOKEN}).test_client()
    response = open_docs.get(path)
    assert response.status_code == 200
    response.close()
    assert_error(open_docs.get("/v1/gradients"), 401, "unauthorized")  # only the docs are open
    closed = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": TOKEN, "BLOCKGRAD_DOCS_PUBLIC": "false"})
    assert_error(closed.test_client().get(path), 401, "unauthorized")
    assert closed.test_client().get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_the_document_says_which_docs_need_no_token():
    for public, security in (("true", []), ("false", None)):
        app = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": TOKEN, "BLOCKGRAD_DOCS_PUBLIC": public})
        spec = app.test_client().get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
        assert spec["security"] == [{"bearerAuth": []}]
        for path in ("/docs", "/docs/", "/openapi.json"):
            assert spec["paths"][path]["get"].get("security") == security, (public, path)


@pytest.mark.parametrize("raw,value", [(None, True), ("", True), ("false", False), ("0", False), ("no", False),
                                       ("off", False), ("TRUE", True), ("1", True), ("yes", True)])
def test_docs_public_setting(raw, value):
    environ = {} if raw is None else {"BLOCKGRAD_DOCS_PUBLIC": raw}
    assert Settings.from_env(environ).docs_public is value


def test_a_bad_docs_public_value_names_the_variable():
    with pytest.raises(ValueError, match="BLOCKGRAD_DOCS_PUBLIC"):
        Settings.from_env({"BLOCKGRAD_DOCS_PUBLIC": "maybe"})


def test_the_document_refuses_null_v2_data_as_the_service_does(client):
    spec = client.get("/openapi.json").get_json()
    validator = OAS30Validator({"$ref": "#/components/schemas/RequestInput", "components": spec["components"]})
    tensor = {"name": "vectors", "shape": [1, 1], "datatype": "FP32"}
    assert validator.is_valid({**tensor, "data": [1.0]}) and validator.is_valid({**tensor, "data": [[1.0]]})
    assert validator.is_valid(tensor)  # binary: no data
    for bad in (None, "1.0", {"x": 1}, [None], ["1.0"]):
        assert not validator.is_valid({**tensor, "data": bad}), bad
        response = client.post("/v2/models/blockgrad/infer", json={"inputs": [{**tensor, "data": bad}]})
        assert response.status_code == 400, bad


def socket_of(pid: int) -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"blockgrad-gunicorn-{pid}.ctl")


def is_socket_soon(path: str, within_s: float = 60.0) -> bool:
    """gunicorn's master starts its control socket after the first workers, which may already
    answer: wait for it, a bounded number of times."""
    for _ in range(int(within_s / 0.05)):
        if os.path.exists(path):
            return stat.S_ISSOCK(os.stat(path).st_mode)
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_each_instance_has_its_own_control_socket():
    with gunicorn_server(workers=1) as first:
        with gunicorn_server(workers=1) as second:
            sockets = [socket_of(first.pid), socket_of(second.pid)]
            assert all(is_socket_soon(path) for path in sockets)
        assert not os.path.exists(sockets[1])  # the second cleaned up its own...
        assert stat.S_ISSOCK(os.stat(sockets[0]).st_mode)  # ...and left the first's alone
        assert first.answers("/healthz")
    assert not os.path.exists(sockets[0])
