"""LMI's output formatters: engine events -> response bytes (pipeline encoders).

Importing this package registers the LMI formatters (json, jsonlines, sse and their tgi_*
variants); see `base` for the contract and selection, `dynamic_batch` for rolling_batch=disable, and
`lmiserve.protocols.lmi.errors` for the error bodies.
"""

from lmiserve.protocols.lmi.formatters import lmi as _lmi  # noqa: F401  (registers the LMI formatters)
from lmiserve.protocols.lmi.formatters.base import (
    FormatOptions,
    Formatter,
    default_formatter_name,
    formatter_names,
    get_formatter,
    register,
    select_formatter_name,
)
from lmiserve.protocols.lmi.formatters.dynamic_batch import (
    DynamicBatchFormatter,
    DynamicBatchStreamFormatter,
)

__all__ = [
    "DynamicBatchFormatter",
    "DynamicBatchStreamFormatter",
    "FormatOptions",
    "Formatter",
    "default_formatter_name",
    "formatter_names",
    "get_formatter",
    "register",
    "select_formatter_name",
]
