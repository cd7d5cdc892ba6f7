"""marshmallow field types shared by the front ends' schemas."""
from marshmallow import ValidationError, fields
from marshmallow.validate import Range, Validator

from ..core.request import unknown_objective
from ..extensions import services


class JsonNumber(fields.Float):
    """A finite JSON number; strings and booleans are refused, not coerced."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (str, bool)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class FactorRange(Range):
    """Documents `minimum: 1` and checks nothing: a factor is checked where N is known (the
    core's factor_refusal: "Must be between 1 and N = <n>.")."""

    def __init__(self):
        super().__init__(min=1)

    def __call__(self, value):
        return value


class ObjectiveName(Validator):
    """One of this server's objectives (built-ins and models), read from the app at load time:
    the objectives are built per app, so a fixed OneOf at import time cannot know it."""

    def __call__(self, value: str) -> str:
        objectives = services().objectives
        if value not in objectives:
            raise ValidationError(unknown_objective(objectives))
        return value
