"""The one exception type every failure is turned into before it reaches HTTP.

Pure Python (no Flask): the numeric and compute layers raise these too.
"""
from typing import Any


class ApiError(Exception):
    """An error the client sees as {"error": {"code", "message", "details"}}."""

    def __init__(self, status: int, code: str, message: str,
                 details: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            error["details"] = self.details
        return {"error": error}


def validation_error(fields: dict[str, Any], message: str | None = None) -> ApiError:
    names = ", ".join(sorted(fields))
    return ApiError(422, "validation_error",
                    message or f"The request is not valid; fix these fields: {names}.",
                    {"fields": fields})


class DeadlineExceeded(ApiError):
    def __init__(self, timeout_s: float, retry_after_s: int):
        super().__init__(
            503, "deadline_exceeded",
            f"The request did not finish within {timeout_s:g} s; retry later, "
            "or send a larger factor or fewer outputs.",
            {"timeout_s": timeout_s}, {"Retry-After": str(retry_after_s)})
