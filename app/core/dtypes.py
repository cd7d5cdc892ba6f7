"""The dtypes a request may compute in: the one table of their sizes."""
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    item_bytes: int  # one number in memory
    text_bytes: int  # the longest JSON text of one number with its comma (-1.2345678901234567e-308,)


DTYPES = {"float32": DType(item_bytes=4, text_bytes=16), "float64": DType(item_bytes=8, text_bytes=25)}
DEFAULT_DTYPE = "float32"
WIDEST = DTYPES["float64"]  # what a dtype outside the table is predicted as
