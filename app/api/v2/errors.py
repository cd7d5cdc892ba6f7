"""The error only /v2 raises; its code, status and meaning are in the one table (app/http/errors.py)."""
from ...http.errors import HttpError, supply_example


def model_not_found(message: str) -> HttpError:
    return HttpError("model_not_found", message)


supply_example("model_not_found", lambda: model_not_found("Unknown model 'other'; this server serves 'blockgrad'."))
