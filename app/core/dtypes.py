"""The dtypes a request may compute in: the one table of their sizes and tensor types."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    item_bytes: int  # one number in memory
    text_bytes: int  # the longest JSON text of one number with its comma (-1.2345678901234567e-308,)
    torch: torch.dtype


DTYPES = {"float32": DType(item_bytes=4, text_bytes=16, torch=torch.float32),
          "float64": DType(item_bytes=8, text_bytes=25, torch=torch.float64)}
DEFAULT_DTYPE = "float32"
UNKNOWN_DTYPE = f"Must be one of: {', '.join(DTYPES)}."
WIDEST = DTYPES["float64"]  # what a dtype outside the table is predicted as
