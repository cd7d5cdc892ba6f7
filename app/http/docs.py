"""The OpenAPI document's prose and error catalogue, and the /docs page's assets.

flask-smorest builds the document from the marshmallow schemas and serves it at
/openapi.json, and renders Swagger UI at /docs (OPENAPI_SWAGGER_UI_* in
app/http/app.py). Swagger UI's files come from the pinned `swagger-ui-bundle`
package and are served here under /docs/assets/, so the page needs no internet.
"""
from collections.abc import Callable
from functools import reduce
from pathlib import Path

from flask import Blueprint, Flask, send_from_directory
from flask_smorest import Api
from marshmallow import Schema, fields
from swagger_ui_bundle import swagger_ui_path

from ..core.objectives import describe
from ..extensions import services_of
from .errors import DEFAULT_STYLE, ERRORS, ErrorStyle
from .settings import Settings

DESCRIPTION = Path(__file__).with_name("api_description.md")  # info.description: str.format template
HEADER_DESCRIPTIONS = {"Allow": ("The methods this path accepts.", "string"),
                       "Retry-After": ("Seconds to wait before retrying.", "integer"),
                       "WWW-Authenticate": ("The Bearer challenge.", "string")}


class ErrorDetailSchema(Schema):
    code = fields.String(required=True, metadata={
        "description": "Stable snake_case error code (the table in the description at the top)."})
    message = fields.String(required=True, metadata={"description": "What went wrong and what to change."})
    details = fields.Dict(required=True, metadata={
        "description": "Always present, {} when the code adds nothing: `fields` (validation_error: field -> list "
                       "of messages), `limit`, `value`, `allowed` (limit_exceeded; too_large: `limit`, `allowed`), "
                       "`routes` (not_found), `allowed` (method_not_allowed), `block` (non_finite_result), "
                       "`timeout_s` (deadline_exceeded)."})


class ErrorSchema(Schema):
    error = fields.Nested(ErrorDetailSchema, required=True)


def error_responses_spec(*codes: str, style: ErrorStyle = DEFAULT_STYLE) -> dict[int, dict]:
    """Group `codes` by the status `style` answers them with: {status: {"description", "examples", "headers"}}."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(style.status(ERRORS[code].status), []).append(code)
    return {status: {"description": "; ".join(f"`{code}`: {ERRORS[code].when}" for code in group),
                     # the documented example: what the constructor that raises the code makes, as sent
                     "examples": {code: {"summary": f"{code}: {ERRORS[code].when}",
                                         "value": style.body(ERRORS[code].example())} for code in group},
                     "headers": {name: {"description": HEADER_DESCRIPTIONS[name][0],
                                        "schema": {"type": HEADER_DESCRIPTIONS[name][1]}}
                                 for code in group for name in ERRORS[code].headers}}
            for status, group in by_status.items()}


def documented(*decorators: Callable) -> Callable:
    """Decorator: the documentation flask-smorest's `decorators` (listed outermost first, as
    they would be stacked) write on a view, without their wrappers in its call path. Only for
    decorators that document and pass a view's Response through (doc, alt_response, and
    response on a view that always returns a Response): each wrapper is a call per request."""
    def decorate(view):
        view._apidoc = reduce(lambda wrapped, decorator: decorator(wrapped), reversed(decorators), view)._apidoc
        return view
    return decorate


def documents_errors(blp, *codes: str, style: ErrorStyle = DEFAULT_STYLE, schema=None) -> Callable:
    """Decorator: one documented error response (schema, examples) per status of `codes`;
    documentation only, the view itself is not wrapped."""
    return documented(*(blp.alt_response(status, schema=schema or ErrorSchema, **{k: v for k, v in spec.items() if v})
                        for status, spec in reversed(error_responses_spec(*codes, style=style).items())))


def api_description(settings: Settings, objectives) -> str:
    """The document's info.description: limits as configured, errors, headers, other endpoints."""
    limits = [
        ("BLOCKGRAD_MAX_BODY_BYTES", "largest request body, in bytes (413 too_large)"),
        ("BLOCKGRAD_MAX_N", "most vectors N (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_D", "longest vector D (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_BLOCK_ELEMENTS", "most numbers in one block, side x side x 2D (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_OUTPUT_ELEMENTS", "most numbers in one answer: blocks `N*N*2D` + accumulated `N*D` "
                                          "+ losses `F*F` (413 limit_exceeded)"),
        ("BLOCKGRAD_REQUEST_TIMEOUT_S", "seconds a request may compute (503 deadline_exceeded)"),
    ]
    rows = "\n".join(f"| `{name}` | {getattr(settings, name.removeprefix('BLOCKGRAD_').lower())} | {meaning} |"
                     for name, meaning in limits)
    codes = "\n".join(f"| {entry.status} | `{code}` | {entry.when} |" for code, entry in ERRORS.items())
    table = "\n".join(f"| `{e['name']}` | {e['kind']} | {'any' if e['dim'] is None else e['dim']} | "
                      f"{', '.join(e['dtypes'])} | {e['description']} |"
                      for e in (describe(name, objective) for name, objective in objectives.items()))
    # The template's tables are folded (<details>) so that the /docs page opens on its operations.
    return DESCRIPTION.read_text().format(rows=rows, objectives=table, codes=codes)


BEARER_SCHEME = "bearerAuth"
OPEN_ROUTE = {"security": []}  # blp.doc(**OPEN_ROUTE): probes and metrics never need the token


def spec_options(settings: Settings, objectives) -> dict:
    """API_SPEC_OPTIONS: the description, and the bearer requirement when a token is set."""
    options = {"info": {"description": api_description(settings, objectives)}}
    if (settings.api_token or "").strip():
        options["security"] = [{BEARER_SCHEME: []}]
    return options


def register_docs(app: Flask, api: Api) -> None:
    """Serve Swagger UI's files under /docs/assets/ and describe /openapi.json and /docs."""
    api.spec.components.security_scheme(BEARER_SCHEME, {
        "type": "http", "scheme": "bearer",
        "description": "Required on every route but the probes and /metrics when BLOCKGRAD_API_TOKEN is set."})
    assets = Blueprint("docs_assets", __name__)

    @assets.route("/docs/assets/<path:filename>")
    def docs_asset(filename: str):
        return send_from_directory(swagger_ui_path, filename, max_age=86400)

    app.register_blueprint(assets)
    # /docs/ is the same page, served directly: a redirect would be built from the Host header.
    app.add_url_rule("/docs/", endpoint="docs_slash", view_func=app.view_functions["api-docs.openapi_swagger_ui"])
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    internal_error = dict(error, description=f"`internal_error`: {ERRORS['internal_error'].when}")
    api.spec.tag({"name": "docs", "description": "This document and its interactive page."})
    rules = {rule.rule: rule for rule in app.url_map.iter_rules()}  # flask-smorest documents a path by its rule
    # With a token set, the documentation stays open unless BLOCKGRAD_DOCS_PUBLIC=false (app/http/auth.py).
    settings = services_of(app).settings
    open_docs = OPEN_ROUTE if settings.docs_public else {}
    page = ("Interactive documentation (Swagger UI, served locally).",
            "An HTML page; its scripts and styles are under /docs/assets/.", "text/html", "string")
    for path, (summary, answer, media_type, kind) in {
            "/openapi.json": ("This OpenAPI 3 document.", "The document.", "application/json", "object"),
            "/docs": page, "/docs/": page}.items():
        api.spec.path(rule=rules[path], operations={"get": {
            "tags": ["docs"], "summary": summary, **open_docs,
            "responses": {"200": {"description": answer, "content": {media_type: {"schema": {"type": kind}}}},
                          "500": internal_error}}})
