"""The one error type of the configuration layer."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value, file or override is invalid.

    The message names the key, the value, what is allowed and, when known, where it came from.
    """
