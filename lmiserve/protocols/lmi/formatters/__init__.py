"""Core events -> response bytes, one module per protocol.

Importing this package registers the LMI formatters (json, jsonlines, sse and their tgi_*
variants); see `base` for the driving protocol and `errors` for failures.
"""

from lmiserve.protocols.lmi.formatters import lmi as _lmi  # noqa: F401  (registers the LMI formatters)
from lmiserve.protocols.lmi.formatters.base import (
    FormatOptions,
    Formatter,
    default_formatter_name,
    formatter_names,
    get_formatter,
    is_error_finish,
    register,
    select_formatter_name,
)
from lmiserve.protocols.lmi.formatters.dynamic_batch import DynamicBatchFormatter, DynamicBatchStreamFormatter
from lmiserve.protocols.lmi.formatters.errors import (
    DEFAULT_ERROR_MESSAGE,
    dynamic_batch_error_body,
    error_message,
    frontend_error_body,
    lmi_error_body,
)

__all__ = [
    "DEFAULT_ERROR_MESSAGE",
    "DynamicBatchFormatter",
    "DynamicBatchStreamFormatter",
    "FormatOptions",
    "Formatter",
    "default_formatter_name",
    "dynamic_batch_error_body",
    "error_message",
    "formatter_names",
    "frontend_error_body",
    "get_formatter",
    "is_error_finish",
    "lmi_error_body",
    "register",
    "select_formatter_name",
]
