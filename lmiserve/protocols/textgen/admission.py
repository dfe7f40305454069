"""Request admission for the TGI and OpenAI routes (`max_concurrent_requests`): a request holds a
slot from validation until its response ends; with every slot taken it is refused at once
(`Overloaded`), never queued."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Self

from starlette.requests import Request

from lmiserve.core.errors import Overloaded


class Admission:
    """At most `limit` requests in flight; `try_enter` never waits."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_enter(self) -> Callable[[], None] | None:
        """A release function (idempotent) when a slot was free, else None."""
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release


class Slot:
    """A held admission slot. As a context manager it is released when the block raises; otherwise
    whoever answers (the response pipeline's `on_close`) releases it."""

    def __init__(self, release: Callable[[], None]):
        self.release = release

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.release()


def admission(request: Request) -> Admission:
    """The server's one admission counter (made on first use)."""
    state = request.app.state
    if getattr(state, "tgi_admission", None) is None:
        state.tgi_admission = Admission(state.settings.max_concurrent_requests)
    return state.tgi_admission


def enter(request: Request) -> Slot:
    """A free slot, else `Overloaded`."""
    release = admission(request).try_enter()
    if release is None:
        raise Overloaded("Model is overloaded")
    return Slot(release)
