"""An engine of the tests' models, running for the length of a `with` block."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel


@contextlib.asynccontextmanager
async def running_engine(loaded: LoadedModel, **config: Any) -> AsyncIterator[AsyncEngine]:
    """`create_engine(loaded, EngineConfig(**config))`, started, stopped on leaving."""
    engine = create_engine(loaded, EngineConfig(**config))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
