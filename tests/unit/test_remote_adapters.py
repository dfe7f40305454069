"""engine/process/adapters.py: the LoRA registry as the serving process sees it with `engine_process`, against
a real `AdapterRegistry` answering on another thread as the engine process does (its calls and mirrors)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from lmiserve.core.errors import ModelNotReady
from lmiserve.engine.lora.registry import AdapterRegistry, LoraLimits, UnknownAdapter
from lmiserve.engine.process.adapters import Mirror, RemoteAdapters, call, mirror_of


class Engine:
    """The engine process's side over a real registry: each message sent is answered on a thread of its own."""

    def __init__(self, registry: AdapterRegistry) -> None:
        self.registry = registry
        self.remote = RemoteAdapters(self.send, registry.limits, mirror_of(registry), {"tiny"})
        self.answer = True

    def send(self, message: tuple[Any, ...]) -> None:
        kind, number, method, args, kwargs = message
        assert kind == "adapters"

        def run() -> None:
            try:
                result = call(self.registry, method, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - sent back, raised by the caller
                result = exc
            self.remote.answered(number, result, mirror_of(self.registry))

        if self.answer:
            threading.Thread(target=run).start()


@pytest.fixture
def engine(tiny_model, lora_adapter_dirs: dict[str, Path]) -> Engine:
    return Engine(AdapterRegistry(tiny_model.model, LoraLimits(max_loras=2)))


def test_changes_are_calls_and_the_mirror_follows_them(engine, lora_adapter_dirs):
    remote = engine.remote
    entry = remote.register("a", lora_adapter_dirs["alpha"])
    assert entry.name == "a" and entry.loaded is not None and entry.loaded.modules == {}  # no weights cross
    assert (entry.loaded.rank, entry.loaded.target_modules) == (8, ["q_proj", "v_proj"]) and entry.loaded.nbytes > 0
    assert "a" in remote and remote.names() == ["a"] and remote.loaded_count() == 1
    engine.registry.acquire("a")  # a request of the engine process's: the next mirror says so
    remote.mirror(mirror_of(engine.registry))
    assert remote.in_use("a") == 1 and remote.running() == {"a": 1} and remote.get("a").requests == 1
    with pytest.raises(FileExistsError):
        remote.register("a", lora_adapter_dirs["alpha"])
    remote.unregister("a")
    assert "a" not in remote
    with pytest.raises(UnknownAdapter):
        remote.unregister("a")


def test_an_older_mirror_never_replaces_a_newer_one(engine, lora_adapter_dirs):
    remote = engine.remote
    before = mirror_of(engine.registry)
    remote.register("b", lora_adapter_dirs["beta"])  # its answer's mirror: newer
    remote.mirror(before)  # a step's message sent before the answer, handled after it
    assert "b" in remote
    remote.mirror(Mirror())
    assert remote.names() == ["b"]


def test_the_engine_process_gone_fails_the_call_waiting_and_those_after(engine, lora_adapter_dirs):
    remote = engine.remote
    engine.answer = False  # the engine process died before it answered
    failed: list[BaseException] = []

    def register() -> None:
        try:
            remote.register("c", lora_adapter_dirs["gamma"])
        except BaseException as exc:  # noqa: BLE001 - what the waiting caller gets
            failed.append(exc)

    waiting = threading.Thread(target=register)
    waiting.start()
    remote.fail("the engine process (pid 1) was killed by signal 9")
    waiting.join(10)
    assert not waiting.is_alive() and isinstance(failed[0], ModelNotReady)
    with pytest.raises(ModelNotReady, match="killed by signal 9"):
        remote.unregister("c")
