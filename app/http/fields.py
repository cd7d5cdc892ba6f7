"""marshmallow field types shared by the front ends' schemas."""
from marshmallow import fields


class JsonNumber(fields.Float):
    """A finite JSON number; strings and booleans are refused, not coerced."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (str, bool)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)
