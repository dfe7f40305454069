"""Configuration: serving.properties reader, typed settings and precedence rules.

Precedence, highest first: command line > environment > serving.properties > defaults.
"""

from lmiserve.config.errors import ConfigError
from lmiserve.config.properties import parse_properties, read_properties
from lmiserve.config.settings import Settings
from lmiserve.config.sources import load_settings, parse_override

__all__ = [
    "ConfigError",
    "Settings",
    "load_settings",
    "parse_override",
    "parse_properties",
    "read_properties",
]
