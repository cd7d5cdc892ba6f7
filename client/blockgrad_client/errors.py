"""One exception for every failure: branch on `code`, never on the message.

Server errors carry the service's stable code (read from the X-Blockgrad-Error-Code
header, which every error answer has, on /v1 and /v2 alike), its HTTP status, message
and details (/v2's protocol body {"error": message} has none). Failures on the client's
side of the wire have their own codes and `status` None (or 200 for an answer cut short):

| code | when |
|---|---|
| `connection_failed` | no answer: the connection failed before any byte of one (after the retries) |
| `timeout` | the server sent nothing for `timeout` seconds (not retried: the computation may be running) |
| `incomplete_response` | the answer stopped partway (e.g. the server's deadline passed while it streamed); never retried |
| `bad_response` | the answer could not be read as the service's (not JSON, wrong shape) |
"""
import json
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from typing import Any

ERROR_CODE_HEADER = "X-Blockgrad-Error-Code"
ERROR_BODY_BYTES = 64 * 1024  # an error body is small; never read more than this of one


class BlockgradError(Exception):
    """status: HTTP status (None when no answer came); code: stable snake_case code;
    message: what to change; details: the server's details (may be empty);
    retry_after_s: the server's Retry-After in seconds, when it sent one."""

    def __init__(self, code: str, message: str, *, status: int | None = None,
                 details: dict[str, Any] | None = None, retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}" if status is None else f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.retry_after_s = retry_after_s


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def error_from_answer(status: int, headers, body: bytes) -> BlockgradError:
    """The error an HTTP error answer stands for: code from the header, message and details from the body."""
    code, message, details = headers.get(ERROR_CODE_HEADER), None, {}
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict):  # /v1 and the service's own routes
        code = code or error.get("code")
        message = error.get("message")
        details = error.get("details") if isinstance(error.get("details"), dict) else {}
    elif isinstance(error, str):  # /v2: the protocol's body
        message = error
    if message is None:
        message = body[:500].decode("utf-8", "replace") or f"HTTP {status}"
    return BlockgradError(code or f"http_{status}", message, status=status, details=details,
                          retry_after_s=retry_after_seconds(headers.get("Retry-After")))
