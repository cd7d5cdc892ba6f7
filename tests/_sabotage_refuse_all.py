"""Sabotage for tests/test_suite_catches.py: the request path refuses every request, as 422
non_finite_result, before computing anything (`-p tests._sabotage_refuse_all`)."""
from app.core import run as run_module
from app.core.errors import non_finite_block


def refuse(req, *args, **kwargs):
    raise non_finite_block(0, 0, req.dtype)


run_module.run = refuse  # before app.http.pipeline imports it by name
