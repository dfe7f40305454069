"""An in-process lmiserve app serving an LLM whose engine is a scripted fake, for testing the text
protocols' HTTP layer (LMI, TGI, OpenAI, KServe V2 generate, SageMaker and Vertex on an LLM) without
loading weights or starting a server. The integration tests run the same protocols on real servers.

Only the model is fake. The tokenizer is the real tiny test tokenizer (tests/helpers/tiny_model.py), so
prompt validation (`PromptCodec`), token counts, chat templates and tool prompts go through the real
code; each generated sequence is a real `lmiserve.engine.core.sequence.Sequence` fed with scripted token ids,
so detokenization, stop sequences, stop token ids, EOS, max_new_tokens, grammars (the real
`GrammarCompiler`), thinking budgets (their forced end comes before the script goes on), seeds, prompt logprobs and top tokens produce the events the real engine would; and
the fake is wired into `ModelService` as the real engine is (`ModelService.attach_llm`).

    served = text_app(tgi_compat=True)               # options as `Settings.from_options` takes them
    served.fake.reply(Script(text=" is fun"))        # every request from now on: these tokens, then EOS
    served.fake.reply_once(Script(error=Overloaded("Worker queue capacity exceeded")))  # the next only
    async with served.client() as http:
        r = await http.post("/generate", json={"inputs": "Deep learning", "parameters": {"details": True}})

Without a script a sequence generates "derived" tokens until its budget ends (finish ``length``):
ordinary word tokens picked by a PRNG seeded by the prompt (greedy: the same prompt gives the same
tokens) or by the sequence's seed (sampling: the same seed gives the same tokens, no seed a random one).
`FakeTextGenerator.requests` keeps what the engine was asked, `closed` / `aborted` the ids of requests
whose event iterator was closed (aborted: before every sequence had its final event).

`Exchange` drives the ASGI app by hand (httpx's ASGITransport buffers whole answers and never
disconnects): read a stream chunk by chunk, hold it open, and go away in the middle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import re
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from helpers.tiny_model import TINY_MAX_POSITIONS, build_tiny_tokenizer
from lmiserve.config import Settings
from lmiserve.core.aio import merge_tagged
from lmiserve.core.errors import Overloaded
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.stats import EngineSnapshot
from lmiserve.engine.core.sequence import Sequence as EngineSequence
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.text.grammar_compiler import CompiledGrammar, GrammarCompiler
from lmiserve.engine.text.thinking import ForcedTokens
from lmiserve.engine.text.tokenizer import HfTokenizer
from lmiserve.engine.text.validation import PromptCodec
from lmiserve.models.service import ModelService
from lmiserve.server.app import create_app

__all__ = [
    "DERIVED_LOGPROBS",
    "PROMPT_LOGPROB",
    "Exchange",
    "FakeTextGenerator",
    "Script",
    "TextApp",
    "client",
    "loaded_model",
    "text_app",
    "tiny_tokenizer",
]

# Logprobs of derived tokens (exact binary fractions, so they print as written).
DERIVED_LOGPROBS = (-0.5, -0.25, -1.0, -0.125, -2.0, -0.75)
SCRIPTED_LOGPROB = -0.5  # a scripted token without a logprob of its own
PROMPT_LOGPROB = -1.5  # each prompt token's logprob but the first (None), unless scripted
_WORD = re.compile(r" ?[A-Za-z]{2,}")


@functools.cache
def tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The tiny test tokenizer (512 tokens, byte-level BPE, chat template), built once per process (~1 s):
    the same vocabulary as the tiny model of `tiny_model_dir`."""
    return build_tiny_tokenizer()


@functools.cache
def _grammars(tokenizer) -> GrammarCompiler:
    """One real grammar compiler per tokenizer (it caches compiled grammars)."""
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])


@functools.cache
def _word_ids(tokenizer) -> tuple[int, ...]:
    """Ordinary tokens that decode to a whole ASCII word (with or without a leading space)."""
    special = set(tokenizer.all_special_ids)
    return tuple(
        i for i in range(len(tokenizer)) if i not in special and _WORD.fullmatch(tokenizer.decode([i])) is not None
    )


@dataclass(frozen=True)
class _Device:
    """What the serving layers read of a `torch.device` (importing torch would cost a second a process)."""

    type: str = "cpu"
    index: int | None = None


class _Float32:
    """What the serving layers read of `torch.float32`: its name (TGI's /info ``model_dtype``)."""

    def __str__(self) -> str:
        return "torch.float32"


def loaded_model(tokenizer, max_context: int = TINY_MAX_POSITIONS, name: str = "tiny") -> LoadedModel:
    """What `load_causal_lm` returns for the tiny model on the CPU in fp32, without its weights (`model` is
    None: nothing in the serving layers reads them)."""
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        device=_Device(),
        dtype=_Float32(),
        max_context=max_context,
        eos_token_ids={tokenizer.eos_token_id},
        name=name,
        path=Path(name),
    )


@dataclass(frozen=True)
class Script:
    """What the fake generates for a request.

    Tokens: `text` (its token ids, without special tokens) or `ids`, with their `logprobs` and `top`
    candidates ((id, logprob) pairs, best first; the default puts the token itself first), then the EOS
    token when `eos` (else derived tokens) -- each sequence stops earlier if its parameters say so
    (max_new_tokens, a stop sequence, a stop token id, a complete grammar). With n / best_of > 1,
    `sequences` gives the script of each sequence by index (missing ones: derived tokens; the fake
    ranks them by cumulative logprob, best first, as the engine does). `prompt_logprobs`: the logprobs of
    the prompt tokens when decoder_input_details asks for them (first one None); with `prompt_top_n`, the
    top tokens of each prompt position are `prompt_top`'s (else the token itself first, then as `_top`
    derives them), and each prompt token's rank is 1.

    Failures: `error` is raised from the iteration after `error_after` events (0: before any, as a
    refused submit, a full queue or a queue timeout); `failure` ends every sequence with an error finish
    (FinishReason.ERROR, that message) after `failure_after` tokens, as a failed model step does.

    `events`: replayed as they are instead (no tokenizer, no validation), e.g. LMI's golden events.

    `hold_after`: each sequence waits after that many tokens until `FakeTextGenerator.release()` (a
    stream that stays open; `FakeTextGenerator.holding` is set once one waits).
    """

    text: str | None = None
    ids: Sequence[int] | None = None
    logprobs: Sequence[float] | None = None
    top: Sequence[Sequence[tuple[int, float]]] | None = None
    eos: bool = True
    sequences: Sequence[Script] | None = None
    prompt_logprobs: Sequence[float | None] | None = None
    prompt_top: Sequence[Sequence[tuple[int, float]] | None] | None = None
    error: BaseException | None = None
    error_after: int = 0
    failure: str | None = None
    failure_after: int = 0
    events: Sequence[StepEvent] | None = None
    hold_after: int | None = None


@dataclass(frozen=True)
class _Step:
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class FakeTextGenerator:
    """A `TextGenerator` (lmiserve.core.engine) that generates scripted tokens; see the module docstring."""

    def __init__(
        self,
        tokenizer,
        *,
        max_context: int = TINY_MAX_POSITIONS,
        max_input_len: int | None = None,
        job_queue_size: int = 1000,
        max_running: int = 32,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.codec = PromptCodec(
            HfTokenizer(tokenizer),
            eos_token_ids={self.eos_token_id},
            max_context=max_context,
            max_input_len=max_input_len,
            vocab_size=len(tokenizer),
        )
        self.grammars = _grammars(tokenizer)
        self.job_queue_size = job_queue_size
        self.max_running = max_running
        self._default = Script()
        self._once: deque[Script] = deque()
        self.requests: list[GenerationRequest] = []  # every request `generate` was called with, in order
        self.prepared: list[GenerationRequest] = []  # every request `prepare` was called with
        self.encoded: list[list[int]] = []  # the prompt token ids of every request that passed validation
        self.ran: list[SamplingParams] = []  # the parameters its sequences ran with (`PromptCodec.encoded_params`)
        self.closed: list[str] = []  # request ids whose event iterator was closed (or ran out)
        self.aborted: list[str] = []  # of those, the ones closed before every sequence had its final event
        self.observers: list[Any] = []  # kept, never called: the fake reports no statistics
        self.started = self.stopped = False
        self.running = self.waiting = 0  # sequences generating / held before their first token
        self.generated_tokens = 0
        self.holding = asyncio.Event()
        self._released = asyncio.Event()

    # ---- scripting ---------------------------------------------------------------------------------
    def reply(self, script: Script) -> FakeTextGenerator:
        """Answer every request from now on with `script` (after the ones queued by `reply_once`)."""
        self._default = script
        return self

    def reply_once(self, *scripts: Script) -> FakeTextGenerator:
        """Answer the next requests with these scripts, one each, in order."""
        self._once.extend(scripts)
        return self

    def release(self) -> None:
        """Let the sequences held by `Script.hold_after` go on."""
        self._released.set()

    def ids(self, text: str) -> list[int]:
        """The token ids of `text` (without special tokens), as `Script.text` generates them."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- TextGenerator -----------------------------------------------------------------------------
    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    @property
    def num_waiting(self) -> int:
        return self.waiting

    @property
    def num_running(self) -> int:
        return self.running

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            running=self.running,
            waiting=self.waiting,
            batch_max_tokens=0,
            kv_tokens=0,
            kv_capacity=self.max_running * self.codec.max_context,
            batch_slots=self.max_running,
            generated_tokens=self.generated_tokens,
        )

    def add_observer(self, observer: Any) -> None:
        self.observers.append(observer)

    async def prepare(self, request: GenerationRequest) -> None:
        self.prepared.append(request)
        await self._compile(request)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        self.requests.append(request)
        script = self._once.popleft() if self._once else self._default
        state = _State(sequences=max(request.params.n, request.params.best_of))
        try:
            if script.events is not None:
                for event in script.events:
                    self._check_error(script, state)
                    await asyncio.sleep(0)
                    yield state.note(event)
                self._check_error(script, state)
                return
            self._check_error(script, state)
            async for event in self._generate(request, script, state):
                yield event
                self._check_error(script, state)
        finally:
            self.closed.append(request.request_id)
            if state.finishes < state.sequences:
                self.aborted.append(request.request_id)

    # ---- how ---------------------------------------------------------------------------------------
    async def _compile(self, request: GenerationRequest) -> CompiledGrammar | None:
        grammar = request.params.grammar
        if grammar is None:
            return None
        await asyncio.sleep(0)
        return self.grammars.compile(grammar)  # InvalidRequest when it does not compile, as the engine

    @staticmethod
    def _check_error(script: Script, state: _State) -> None:
        if script.error is not None and state.events == script.error_after:
            raise script.error

    async def _generate(
        self, request: GenerationRequest, script: Script, state: _State
    ) -> AsyncGenerator[StepEvent, None]:
        """The engine's `submit` then its events: one sequence streams, several come whole, best first (not
        `ranked`: interleaved as they are generated)."""
        compiled = await self._compile(request)
        prompt_ids = self.codec.encode(request)
        params = self.codec.encoded_params(request.params)  # as the engine runs them: bad words as ids, ...
        self.ran.append(params)
        self.encoded.append(prompt_ids)
        if self.waiting + state.sequences > self.job_queue_size:
            raise Overloaded("Worker queue capacity exceeded")
        base_seed = params.seed if params.seed is not None else random.SystemRandom().randrange(0, 2**31)
        seqs = [
            EngineSequence(
                i + 1,
                request.request_id,
                request.prompt,
                prompt_ids,
                params,
                tokenizer=self.codec.tokenizer,
                eos_token_ids=self.codec.eos_token_ids,
                special_token_ids=self.codec.special_token_ids,
                seed=base_seed + i,
                index=i,
                grammar=compiled.matcher() if compiled is not None else None,
            )
            for i in range(state.sequences)
        ]
        if params.decoder_input_details:
            logprobs = script.prompt_logprobs or [None] + [PROMPT_LOGPROB] * (len(prompt_ids) - 1)
            ranks: list[int | None] | None = None
            tops: list[list[tuple[int, float]] | None] | None = None
            if params.prompt_top_n is not None:  # scripted, else each prompt token the most likely at its position
                words = _word_ids(self.tokenizer)
                ranks = [None if lp is None else 1 for lp in logprobs]
                scripted = script.prompt_top or [None] * len(logprobs)
                tops = [
                    None
                    if lp is None
                    else list(
                        (scripted[i] if scripted[i] is not None else _top(token_id, lp, words))[: params.prompt_top_n]
                    )
                    for i, (token_id, lp) in enumerate(zip(prompt_ids, logprobs))
                ]
            for seq in seqs:
                seq.add_prompt_logprobs(0, list(logprobs), ranks, tops)
        scripts = [self._script_of(script, i) for i in range(len(seqs))]
        runs = [self._run(seq, s, script) for seq, s in zip(seqs, scripts)]
        if len(seqs) == 1:
            async with contextlib.aclosing(runs[0]):
                async for event in runs[0]:
                    yield state.note(event)
            return
        if not request.ranked and params.n == len(seqs):  # as they are generated, interleaved (OpenAI's n)
            async with contextlib.aclosing(merge_tagged(runs)) as merged:
                async for _, event in merged:
                    yield state.note(event)
            return
        collected = []
        for run in runs:
            async with contextlib.aclosing(run):
                collected.append([event async for event in run])
        ranked = sorted(range(len(seqs)), key=lambda i: seqs[i].cumulative_logprob, reverse=True)
        state.sequences = params.n  # the others finished too, and are left out
        for new_index, old in enumerate(ranked[: params.n]):
            for event in collected[old]:
                yield state.note(StepEvent(event.token, event.top_tokens, event.finish, new_index))

    @staticmethod
    def _script_of(script: Script, index: int) -> Script | None:
        if script.sequences is not None:
            return script.sequences[index] if index < len(script.sequences) else None
        return script if index == 0 and (script.text is not None or script.ids is not None) else None

    async def _run(self, seq: EngineSequence, own: Script | None, script: Script) -> AsyncGenerator[StepEvent, None]:
        """One sequence's events, a token at a time."""
        params = seq.params
        self.waiting += 1
        waiting = True
        try:
            for count, step in enumerate(_forced_first(seq, self._steps(seq, own), _word_ids(self.tokenizer))):
                if script.hold_after is not None and count == script.hold_after and not self._released.is_set():
                    self.holding.set()
                    await self._released.wait()
                if waiting:
                    self.waiting, self.running, waiting = self.waiting - 1, self.running + 1, False
                await asyncio.sleep(0)
                if script.failure is not None and count == script.failure_after:
                    yield seq.end(FinishReason.ERROR, script.failure)
                    return
                if step.id == self.eos_token_id and len(seq.output_ids) < params.min_new_tokens:
                    continue  # the engine never samples EOS before min_new_tokens
                top = list(step.top[: params.top_n_tokens]) if params.top_n_tokens else None
                event = seq.on_token(step.id, step.logprob, top)
                self.generated_tokens += 1
                yield event
                if event.finish is not None:
                    return
        finally:
            if waiting:
                self.waiting -= 1
            else:
                self.running -= 1

    def _steps(self, seq: EngineSequence, own: Script | None) -> Iterator[_Step]:
        """The scripted tokens (then EOS), then derived ones without end."""
        words = _word_ids(self.tokenizer)
        if own is not None:
            ids = self.ids(own.text) if own.text is not None else list(own.ids or ())
            for i, token_id in enumerate(ids):
                logprob = own.logprobs[i] if own.logprobs is not None else SCRIPTED_LOGPROB
                top = tuple(own.top[i]) if own.top is not None else _top(token_id, logprob, words)
                yield _Step(token_id, logprob, top)
            if own.eos:
                yield _Step(self.eos_token_id, SCRIPTED_LOGPROB, _top(self.eos_token_id, SCRIPTED_LOGPROB, words))
        rng = random.Random(seq.seed if seq.params.do_sample else zlib.crc32(json.dumps(seq.prompt_ids).encode()))
        while True:
            token_id, logprob = rng.choice(words), rng.choice(DERIVED_LOGPROBS)
            yield _Step(token_id, logprob, _top(token_id, logprob, words))


def _forced_first(seq: EngineSequence, steps: Iterator[_Step], words: Sequence[int]) -> Iterator[_Step]:
    """`steps`, with the tokens the engine's mask forces (a thinking budget's end of the block) put before
    the next one whenever the sequence has them due."""
    for step in steps:
        while isinstance(seq.grammar, ForcedTokens) and not seq.grammar.done:
            token_id = seq.grammar.ids[seq.grammar.at]
            yield _Step(token_id, SCRIPTED_LOGPROB, _top(token_id, SCRIPTED_LOGPROB, words))
        yield step


def _top(token_id: int, logprob: float, words: Sequence[int]) -> tuple[tuple[int, float], ...]:
    """The token itself first, then other word tokens, each 0.5 less likely than the one before."""
    others = [w for w in words[:21] if w != token_id][:19]
    return ((token_id, logprob), *((w, logprob - 0.5 * (k + 1)) for k, w in enumerate(others)))


@dataclass
class _State:
    sequences: int
    events: int = 0
    finishes: int = 0

    def note(self, event: StepEvent) -> StepEvent:
        self.events += 1
        if event.finish is not None:
            self.finishes += 1
        return event


# ---- the app -----------------------------------------------------------------------------------------


@dataclass
class TextApp:
    app: Any  # the starlette app
    fake: FakeTextGenerator
    service: ModelService
    others: list[ModelService] = field(default_factory=list)

    def client(self, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
        return client(self.app, raise_app_exceptions=raise_app_exceptions)

    @property
    def name(self) -> str:
        return self.service.name

    def exchange(self, path: str, body: Any = None, **kwargs: Any) -> Exchange:
        return Exchange(self.app, path, body, **kwargs)


def text_app(
    *,
    name: str = "tiny",
    status: str = ModelService.READY,
    max_context: int = TINY_MAX_POSITIONS,
    others: Mapping[str, Any] | None = None,
    fake: FakeTextGenerator | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> TextApp:
    """The app serving one LLM, `name`, over a new `FakeTextGenerator` (or `fake`) with the tiny tokenizer
    (or `tokenizer`, e.g. `helpers.tiny_model.build_thinking_tokenizer()`'s).

    `options` go to `Settings.from_options` (tgi_compat, output_formatter, api_key, max_input_len,
    max_concurrent_requests, rolling_batch, vertex_predict_route, ...); `max_input_len` and
    `job_queue_size` also reach the fake, as they reach the engine. `status`: READY, PENDING (loading)
    or FAILED. `max_context`: the model's context (the tiny model's 256 tokens by default; tool prompts
    need more). `others`: more models by name, `helpers.tensor_app.NumpyModel`s (one-shot models).
    """
    settings = Settings.from_options(options)
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    if fake is None:
        fake = FakeTextGenerator(
            tokenizer,
            max_context=max_context,
            max_input_len=settings.max_input_len,
            job_queue_size=settings.job_queue_size,
            max_running=settings.max_rolling_batch_size,
        )
    service = ModelService(settings, name=name, kind="llm")
    extra = []
    for other, model in (others or {}).items():
        svc = ModelService(settings, name=other, kind=model.kind)
        svc.status, svc._tensor_model = ModelService.READY, model
        extra.append(svc)
    app = create_app(settings, services=[service, *extra])  # registers the metrics' observers first
    # what `ModelService.load` does once the model is in memory (the lifespan, which loads, does not run)
    service.attach_llm(loaded_model(tokenizer, max_context, name), fake)
    fake.start()
    service.status = status
    if status == ModelService.FAILED:
        service.error = "scripted load failure"
    return TextApp(app, fake, service, extra)


def client(app, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    """An httpx client of the app. `raise_app_exceptions=False`: an exception that escapes the app is
    answered as a server answers it (the app's own 500 body) instead of raised in the test."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


# ---- driving the ASGI app by hand --------------------------------------------------------------------


class Exchange:
    """One request to the app, its answer read as it comes; the client may go away at any moment.

    async with served.exchange("/generate_stream", {"inputs": "Hi"}) as ex:
        first = await ex.chunk()
        await ex.disconnect()
    """

    def __init__(
        self,
        app,
        path: str,
        body: Any = None,
        *,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
    ) -> None:
        self.app = app
        raw = content if content is not None else json.dumps(body).encode()
        heads = {"content-type": "application/json", **(headers or {}), "content-length": str(len(raw))}
        path, _, query = path.partition("?")
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in heads.items()],
            "server": ("test", 80),
            "client": ("127.0.0.1", 12345),
        }
        self._body = raw
        self._sent_body = False
        self._gone = asyncio.Event()
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []  # every non-empty body chunk, in order
        self.complete = False  # the app sent the end of the body
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Exchange:
        self._task = asyncio.ensure_future(self.app(self.scope, self._receive, self._send))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

    async def _receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.append(message["body"])
                await self._chunks.put(message["body"])
            if not message.get("more_body", False):
                self.complete = True
                await self._chunks.put(None)

    async def chunk(self, timeout: float = 5.0) -> bytes | None:
        """The next body chunk; None once the body is complete (or the app ended without a body)."""
        assert self._task is not None, "use `async with`"
        if self._chunks.empty() and not self._task.done():
            getter = asyncio.ensure_future(self._chunks.get())
            done, _ = await asyncio.wait({getter, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                return getter.result()
            getter.cancel()
            if not done:
                raise AssertionError(f"no chunk within {timeout} s")
        if not self._chunks.empty():
            return self._chunks.get_nowait()
        self._task.result()  # the app ended: raises what it raised
        return None

    async def disconnect(self, timeout: float = 5.0) -> None:
        """The client goes away; waits until the app is done with the request."""
        self._gone.set()
        if self._task is not None:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def finish(self, timeout: float = 5.0) -> bytes:
        """Wait for the whole answer (the client stays); its body."""
        assert self._task is not None, "use `async with`"
        await asyncio.wait_for(asyncio.shield(self._task), timeout)
        return b"".join(self.chunks)
