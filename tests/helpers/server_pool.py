"""Real servers shared by every test of a session: one `python -m lmiserve serve` per configuration.

Starting a server imports torch and loads a model (seconds on two cores), so tests that need the same
configuration share one process instead of each module starting its own:

    def test_something(server_pool, tiny_model_dir):
        url = server_pool.url(["--model-id", str(tiny_model_dir)])

The first call for a configuration (its arguments and environment) starts the server; later calls
return the same URL; every server stops at the end of the session (under pytest-xdist: of the
worker). Share only servers whose tests do not depend on a fresh process (counters from zero, a log
read from its start, a model loaded or unloaded through the management API): those start their own
with `helpers.server.run_server`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from helpers.server import DEFAULT_STARTUP_TIMEOUT, run_server


class ServerPool:
    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._urls: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], str] = {}

    def url(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, *, timeout: float = DEFAULT_STARTUP_TIMEOUT
    ) -> str:
        """The base URL of the shared server started with `args` and `env` (started now if it is the first)."""
        key = (tuple(args), tuple(sorted((env or {}).items())))
        if key not in self._urls:
            self._urls[key] = self._stack.enter_context(run_server(args, env, timeout=timeout))
        return self._urls[key]

    def close(self) -> None:
        self._stack.close()
