"""The fixed prompt set of `lmiserve bench`: plain English, lengths from a few words to ~170 words
(about 6 to 230 tokens for SmolLM2's tokenizer), in a fixed order, so every run, server and baseline
sees the same inputs. The longest prompt needs a context of about 230 tokens plus the new tokens;
the soak (many short requests) uses the prompts of at most 20 words only.

Client `c` of a level sends prompts `c, c + C, c + 2C, ...` (modulo the set, `C` the concurrency);
the in-process baselines at batch size `B` use prompts `0 .. B-1` (cycling past the end).
"""

from __future__ import annotations

_LONG_CONTEXT = (
    "The river town had grown up around a single stone bridge, built three centuries ago by masons "
    "who were paid in grain and salt. Every spring the water rose to within a hand of the arches, "
    "and every spring the older residents gathered on the bank to watch, half hoping and half "
    "fearing that this would be the year it finally reached the keystone. It never did. The bridge "
    "carried carts, then bicycles, then a narrow road of cars that had to take turns, and the town "
    "grew a market square, a school, two bakeries that did not speak to each other, and a library "
    "that was open on Tuesdays and Saturdays. "
)

PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea.",
    "Explain what a hash table is and when you would use one.",
    "List three practical tips for keeping a vegetable garden healthy during a dry summer.",
    "The history of the printing press began",
    "Summarise the main causes of inflation for someone who has never studied economics, "
    "using everyday examples such as the price of bread, rent and the cost of a bus ticket.",
    "Translate the following sentence into French and explain each word: the cat is sleeping on the warm windowsill.",
    _LONG_CONTEXT + "Continue the story of the town, describing what happened the year the river froze.",
    "Once upon a time",
    "Describe, step by step, how a web browser loads a page after you type an address and press "
    "enter, from the name lookup to the moment the first pixels are drawn on the screen.",
    "What are the differences between a virus and a bacterium? Answer in a few sentences.",
    _LONG_CONTEXT + _LONG_CONTEXT[:400] + " Write a letter from the librarian to the mayor.",
    "Give me a recipe for a simple tomato soup.",
    "A train leaves the station at nine in the morning travelling at sixty kilometres an hour, and "
    "a second train leaves the same station an hour later at ninety kilometres an hour on a parallel "
    "track. Explain how to work out when the second train catches up with the first.",
    "Why is the sky blue?",
    "Write the opening paragraph of a detective novel set in a lighthouse during a storm, where the "
    "keeper has just found a stranger's boat tied to the rocks below.",
    "Compare walking, cycling and taking the bus as ways to get to work in a small city.",
)


SHORT_PROMPTS: tuple[str, ...] = tuple(p for p in PROMPTS if len(p.split()) <= 20)

# `--prompt-set repeat`: requests whose answer repeats or edits a passage of the prompt (what prompt
# lookup speeds up: extraction, edits, quoting). Written in the bundled model's chat format (ChatML), so
# a raw completion request (LMI /invocations, a peer's /v1/completions) gets the instruct model's answer.
_PASSAGES: tuple[tuple[str, str], ...] = (
    ("Repeat the following paragraph exactly, word for word.", _LONG_CONTEXT),
    (
        "Rewrite this Python function with the variable name `total` renamed to `result`; change nothing else.",
        "def add_all(values):\n    total = 0\n    for value in values:\n        if value is None:\n"
        "            continue\n        total = total + value\n    return total\n\n\n"
        "def average(values):\n    total = add_all(values)\n    count = len([v for v in values if v is not None])\n"
        "    return total / count if count else 0.0\n",
    ),
    (
        "Copy out the sentences of this text that mention the library, unchanged.",
        _LONG_CONTEXT + "The library kept a ledger of every book lent since the day it opened, and the "
        "librarian read a page of it aloud at the spring festival.",
    ),
    (
        "Correct the spelling in this text and return the whole corrected text.",
        "The comittee met on tuesday to discus the new budjet for the libary. Every member agreed that the "
        "roof needed repairs before the winter, and that the childrens' reading room should stay open on "
        "saturdays. The treasurer said the town could aford both if the market fees rose a little.",
    ),
    (
        "Repeat this list in the same order, adding a full stop at the end of every line.",
        "\n".join(
            f"{n}. {item}"
            for n, item in enumerate(
                (
                    "Check the tyres before a long drive",
                    "Keep a spare bulb for the headlights",
                    "Change the oil every ten thousand kilometres",
                    "Top up the washer fluid in autumn",
                    "Test the battery before winter",
                    "Carry a blanket and water in the boot",
                    "Clean the windscreen inside and out",
                    "Replace the wiper blades once a year",
                ),
                start=1,
            )
        ),
    ),
)
REPEAT_PROMPTS: tuple[str, ...] = tuple(
    f"<|im_start|>user\n{ask}\n\n{passage}<|im_end|>\n<|im_start|>assistant\n" for ask, passage in _PASSAGES
)
PROMPT_SETS: dict[str, tuple[str, ...]] = {"general": PROMPTS, "repeat": REPEAT_PROMPTS}
_active: tuple[str, ...] = PROMPTS


def select_prompt_set(name: str) -> None:
    """Use the prompt set `name` (`PROMPT_SETS`) for this process's requests and baselines."""
    global _active
    _active = PROMPT_SETS[name]


def active_prompt_set() -> str:
    """The name of the prompt set this process uses (`select_prompt_set`)."""
    return next(name for name, prompts in PROMPT_SETS.items() if prompts is _active)


def soak_prompt(index: int) -> str:
    """The prompt of soak request `index`: the short prompts only (about 4 to 22 tokens), in turn."""
    return SHORT_PROMPTS[index % len(SHORT_PROMPTS)]


def prompt_for(index: int) -> str:
    """The `index`-th prompt of the selected set, cycling past the end."""
    return _active[index % len(_active)]


def client_prompt(client: int, request: int, concurrency: int) -> str:
    """The prompt of request number `request` of client `client` at `concurrency` clients."""
    return prompt_for(client + request * concurrency)


def batch_prompts(batch_size: int) -> list[str]:
    """The prompts of a static batch of `batch_size` (the baselines' inputs)."""
    return [prompt_for(i) for i in range(batch_size)]
