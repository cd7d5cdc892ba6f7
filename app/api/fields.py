"""marshmallow field types shared by the front ends' schemas."""
from marshmallow import ValidationError, fields
from marshmallow.validate import Validator

from ..core.request import unknown_objective
from ..extensions import services


class JsonNumber(fields.Float):
    """A finite JSON number; strings and booleans are refused, not coerced."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (str, bool)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class ObjectiveName(Validator):
    """One of this server's objectives (built-ins and models), read from the app at load time:
    the objectives are built per app, so a fixed OneOf at import time cannot know it."""

    def __call__(self, value: str) -> str:
        objectives = services().objectives
        if value not in objectives:
            raise ValidationError(unknown_objective(objectives))
        return value
