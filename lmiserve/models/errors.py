"""The error of a model that could not be had (importable from `lmiserve.models` too): the lowest module of
the package, so every loader and downloader raises it without importing the package's front door."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model could not be located, converted or loaded; the message says what to do."""
