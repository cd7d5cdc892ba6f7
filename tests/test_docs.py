"""/openapi.json is a valid, complete OpenAPI 3 document; /docs works without internet."""
import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import pytest
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate

from app import create_app

# Error codes and their statuses, as the contract and docs/api.md list them.
CONTRACT_ERRORS = {
    "bad_json": 400, "too_large": 413, "limit_exceeded": 413, "unsupported_media_type": 415,
    "validation_error": 422, "non_finite_result": 422, "deadline_exceeded": 503, "internal_error": 500,
    "unauthorized": 401, "device_out_of_memory": 503,  # issue 3
}
UNDOCUMENTED_ENDPOINTS = {"static", "docs_assets.docs_asset"}  # files, not API operations


@pytest.fixture
def spec(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.get_json()


def openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def error_validator(spec) -> OAS30Validator:
    return OAS30Validator({"$ref": "#/components/schemas/Error", "components": spec["components"]})


def test_document_validates(spec):
    validate(spec)
    assert spec["openapi"].startswith("3.")


def test_every_route_is_documented(app, spec):
    rules = [rule for rule in app.url_map.iter_rules() if rule.endpoint not in UNDOCUMENTED_ENDPOINTS]
    assert {openapi_path(rule.rule) for rule in rules} >= {
        "/v1/gradients", "/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"}
    for rule in rules:
        path = openapi_path(rule.rule)
        assert path in spec["paths"], path
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in spec["paths"][path], (path, method)


def test_every_operation_documents_its_errors_with_the_error_body(spec):
    for path, operations in spec["paths"].items():
        if path.startswith("/v2"):  # Open Inference Protocol routes: {"error": "..."} by that protocol
            continue
        for method, operation in operations.items():
            if method == "parameters":  # the path's own parameters (/v1/jobs/{job_id}), not an operation
                continue
            responses = operation["responses"]
            assert "500" in responses, (path, method)
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (path, method, status)


def test_gradients_documents_every_contract_error_with_a_valid_example(spec):
    responses = spec["paths"]["/v1/gradients"]["post"]["responses"]
    validator = error_validator(spec)
    for code, status in CONTRACT_ERRORS.items():
        response = responses[str(status)]
        assert f"`{code}`" in response["description"]
        example = response["content"]["application/json"]["examples"][code]["value"]
        validator.validate(example)
        assert example["error"]["code"] == code
    assert "Retry-After" in responses["503"]["headers"]
    assert "not_ready" in spec["paths"]["/readyz"]["get"]["responses"]["503"]["description"]


def test_request_fields_defaults_and_limits_are_documented(spec):
    schema = spec["components"]["schemas"]["GradientRequest"]
    properties = schema["properties"]
    assert schema["required"] == ["vectors"]
    assert schema["additionalProperties"] is False
    assert set(properties) == {"vectors", "factor", "objective", "offset", "outputs", "dtype"}
    assert all(prop.get("description") for prop in properties.values())
    assert properties["objective"]["default"] == "sum"
    assert properties["offset"]["default"] == 5.0
    assert properties["outputs"]["default"] == ["blocks", "accumulated"]
    assert properties["dtype"]["default"] == "float32"
    assert set(properties["objective"]["enum"]) == {"sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"}
    assert set(properties["outputs"]["items"]["enum"]) == {"blocks", "accumulated", "losses"}
    assert properties["dtype"]["enum"] == ["float32", "float64"]
    assert properties["factor"]["type"] == "integer" and properties["factor"]["minimum"] == 1
    assert "ceil(N / 6)" in properties["factor"]["description"]
    assert "BLOCKGRAD_MAX_N" in properties["vectors"]["description"]
    assert "BLOCKGRAD_MAX_BLOCK_ELEMENTS" in properties["factor"]["description"]
    assert "BLOCKGRAD_MAX_OUTPUT_ELEMENTS" in properties["outputs"]["description"]
    response = spec["components"]["schemas"]["GradientResponse"]
    assert set(response["required"]) == {"n", "dim", "factor", "bounds", "objective", "dtype", "device"}
    assert set(response["properties"]) == {"n", "dim", "factor", "bounds", "objective", "dtype", "device",
                                           "accumulated", "losses", "blocks"}


def test_description_shows_this_servers_limits():
    app = create_app({"TESTING": True, "BLOCKGRAD_MAX_N": 77, "BLOCKGRAD_MAX_D": 33,
                      "BLOCKGRAD_MAX_BODY_BYTES": 1234567})
    description = app.test_client().get("/openapi.json").get_json()["info"]["description"]
    assert "| `BLOCKGRAD_MAX_N` | 77 |" in description
    assert "| `BLOCKGRAD_MAX_D` | 33 |" in description
    assert "| `BLOCKGRAD_MAX_BODY_BYTES` | 1234567 |" in description
    for code in ("not_found", "method_not_allowed", *CONTRACT_ERRORS):
        assert f"`{code}`" in description
    assert "X-Request-ID" in description


@pytest.mark.parametrize("method,path,kwargs,status", [
    ("get", "/nowhere", {}, 404),
    ("post", "/healthz", {}, 405),
    ("post", "/v1/gradients", {"data": "x", "content_type": "text/plain"}, 415),
    ("post", "/v1/gradients", {"data": "{", "content_type": "application/json"}, 400),
    ("post", "/v1/gradients", {"json": {"vectors": [[1.0]], "factor": 2}}, 422),
])
def test_real_error_bodies_match_the_documented_schema(client, spec, method, path, kwargs, status):
    response = getattr(client, method)(path, **kwargs)
    assert response.status_code == status
    error_validator(spec).validate(response.get_json())


class AssetLinks(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def test_docs_page_uses_only_local_assets(client):
    response = client.get("/docs")
    assert response.status_code == 200 and response.mimetype == "text/html"
    page = response.get_data(as_text=True)
    assert "://" not in page  # no CDN, no absolute URL of any kind
    parser = AssetLinks()
    parser.feed(page)
    spec_urls = re.findall(r'url:\s*"([^"]+)"', page)
    assert spec_urls == ["/openapi.json"]
    assert any(url.endswith("swagger-ui-bundle.js") for url in parser.urls)
    assert any(url.endswith("swagger-ui.css") for url in parser.urls)
    for url in parser.urls + spec_urls:
        absolute = urljoin("http://localhost/docs", url)
        assert urlsplit(absolute).netloc == "localhost", url
        asset = client.get(urlsplit(absolute).path)
        assert asset.status_code == 200, url
        assert len(asset.get_data()) > 0
        asset.close()
    assert client.get("/docs/assets/swagger-ui-bundle.js").mimetype in ("text/javascript", "application/javascript")
    assert client.get("/docs/assets/nothing-here.js").status_code == 404
    assert client.get("/docs/assets/../../__init__.py").status_code == 404


def test_bearer_scheme_is_declared_and_required_only_with_a_token(spec):
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]["bearerAuth"]["description"]}
    assert "security" not in spec  # no token configured: nothing required
    locked = create_app({"TESTING": True, "BLOCKGRAD_API_TOKEN": "t0ken"}).test_client()
    locked_spec = locked.get("/openapi.json", headers={"Authorization": "Bearer t0ken"}).get_json()
    assert locked_spec["security"] == [{"bearerAuth": []}]
    for path in ("/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"):
        assert locked_spec["paths"][path]["get"]["security"] == [], path  # probes stay open
    assert "security" not in locked_spec["paths"]["/v1/gradients"]["post"]  # inherits the requirement
