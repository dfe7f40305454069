"""The chat scenario's conversations and its per-turn figures (pure Python, no I/O).

Every conversation starts with the same system prompt (what a chat product sends with every request),
then alternates user messages and the assistant's replies; each turn resends the whole history, as
chat clients do over OpenAI ``/v1/chat/completions``. Conversation `k`'s first user message names the
conversation (so no two conversations share more than the system prompt) and asks one of the bench's
prompts; later turns ask fixed follow-up questions. Turn `t` of a conversation therefore shares with
turn `t - 1` everything but the last reply and the new question: the work a prefix cache saves.

Per turn index the figures are TTFT p50/p99, ITL p50/p99, the mean per-request decode rate and, when
the server reports them (OpenAI ``usage``), the prompt and cached prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmiserve.bench.prompts import prompt_for
from lmiserve.bench.stats import RequestRecord, distribution_ms, level_summary, ratio

Json = dict[str, Any]

SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small engineering consultancy. Answer in plain "
    "English, in short paragraphs, and keep every answer practical: say what to do first, what it "
    "costs, and what could go wrong. When a question is ambiguous, state the assumption you make "
    "instead of asking back. Never invent figures; when you estimate, say that it is an estimate and "
    "how you arrived at it. Use metric units. If the user asks for a list, give at most five items. "
    "If the user changes the subject, follow them without comment. Be concise: the user reads your "
    "answers on a phone, between meetings, and prefers one clear recommendation to a survey of options."
)

FOLLOW_UPS: tuple[str, ...] = (
    "Thanks. Can you go into more detail on the most important point?",
    "What would you change if the budget were cut in half?",
    "Summarise everything so far in three short bullet points.",
    "What is the single biggest risk, and how would you reduce it?",
    "Give me a one-sentence version I can send to my manager.",
    "Which of these steps could wait until next year?",
)

# turns whose TTFT shows a prefix cache's effect (their history holds at least two earlier replies)
LATE_TURN = 3


def user_message(conversation: int, turn: int) -> str:
    """The user's message at `turn` (1-based) of conversation `conversation`."""
    if turn < 1:
        raise ValueError(f"turns start at 1, got {turn}")
    if turn == 1:
        return f"(Conversation {conversation}.) {prompt_for(conversation)}"
    return FOLLOW_UPS[(turn - 2 + conversation) % len(FOLLOW_UPS)]


@dataclass
class Conversation:
    """One conversation's history: the system prompt, then user/assistant messages."""

    number: int
    system_prompt: str = SYSTEM_PROMPT
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": self.system_prompt}]

    @property
    def turn(self) -> int:
        """The turn number of the next request (1 for a new conversation)."""
        return sum(1 for m in self.messages if m["role"] == "user") + (0 if self.awaiting_reply else 1)

    @property
    def awaiting_reply(self) -> bool:
        return self.messages[-1]["role"] == "user"

    def ask(self) -> list[dict[str, str]]:
        """Append the next user message and return the whole history to send (a copy)."""
        if self.awaiting_reply:
            raise RuntimeError("the last user message has no reply yet")
        self.messages.append({"role": "user", "content": user_message(self.number, self.turn)})
        return [dict(m) for m in self.messages]

    def reply(self, text: str) -> None:
        """Append the assistant's reply to the last user message."""
        if not self.awaiting_reply:
            raise RuntimeError("no user message awaits a reply")
        self.messages.append({"role": "assistant", "content": text})


def conversation_number(client: int, conversation_index: int, concurrency: int) -> int:
    """Conversation `conversation_index` of client `client`: numbers 0, 1, ... across the clients."""
    return client + conversation_index * concurrency


def _decode_rate(record: RequestRecord) -> float | None:
    """(tokens - 1) / (last token - first token): one request's own decode rate."""
    times = record.token_times
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def turn_summaries(records: Sequence[RequestRecord]) -> list[Json]:
    """Per turn index, over the measured requests that succeeded."""
    measured = [r for r in records if not r.warmup and r.error is None and r.turn is not None]
    out = []
    for turn in sorted({r.turn for r in measured if r.turn is not None}):
        mine = [r for r in measured if r.turn == turn]
        itl = [b - a for r in mine for a, b in zip(r.token_times, r.token_times[1:])]
        rates = [rate for r in mine if (rate := _decode_rate(r)) is not None]
        prompt = [r.prompt_tokens for r in mine if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in mine if r.cached_tokens is not None]
        out.append(
            {
                "turn": turn,
                "requests": len(mine),
                "ttft_ms": distribution_ms(r.ttft for r in mine if r.ttft is not None),
                "itl_ms": distribution_ms(itl),
                "request_tokens_per_s": _mean(rates),
                "tokens_received": sum(r.tokens for r in mine),
                "prompt_tokens_mean": _mean([float(p) for p in prompt]),
                "cached_tokens_mean": _mean([float(c) for c in cached]),
            }
        )
    return out


def _ttft_p50_ms(records: Sequence[RequestRecord], turns: range) -> float | None:
    values = [r.ttft for r in records if not r.warmup and r.error is None and r.turn in turns and r.ttft is not None]
    return distribution_ms(values)["p50"] if values else None


def chat_level_summary(concurrency: int, records: Sequence[RequestRecord], elapsed: float) -> Json:
    """A level's usual figures (tokens/s over the steady window, TTFT, ITL), plus per turn, and TTFT
    p50 of turn 1 against turns >= 3."""
    level = level_summary(concurrency, records, elapsed)
    turn1 = _ttft_p50_ms(records, range(1, 2))
    late = _ttft_p50_ms(records, range(LATE_TURN, 1 << 30))
    return {
        **level,
        "conversations": len({(r.client, r.conversation) for r in records if not r.warmup}),
        "turns": turn_summaries(records),
        "ttft_p50_turn1_ms": turn1,
        "ttft_p50_late_turns_ms": late,
        "late_over_turn1": ratio(late, turn1),
    }


def late_ttft_ratios(a_levels: Sequence[Json], b_levels: Sequence[Json]) -> list[Json]:
    """Per concurrency: TTFT p50 of turns >= 3 of run A over run B (e.g. prefix cache on / off)."""
    by_c = {lv["concurrency"]: lv for lv in b_levels}
    out = []
    for level in a_levels:
        c = level["concurrency"]
        a, b = level.get("ttft_p50_late_turns_ms"), by_c.get(c, {}).get("ttft_p50_late_turns_ms")
        out.append({"concurrency": c, "a_ms": a, "b_ms": b, "a_over_b": ratio(a, b)})
    return out
