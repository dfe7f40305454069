"""Reading a tool-calling answer as it is generated: whatever the token boundaries, the pieces say the
same thing, calls are listed only when complete, and a plain answer is decoded from its JSON string."""

from __future__ import annotations

import json
import random

import pytest

from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content, ToolOutput

ONE_CALL = '{"name": "get_weather", "parameters": {"city": "Pa\\"ris \\u00e9", "days": [1, 2], "x": null}}'
TWO_CALLS = '[{"name":"a","parameters":{}}, {"name":"b","parameters":{"x":-1.5e3,"ok":true}}]'
CONTENT = '{"content": "Hello \\ud83c\\udf89 w\\u00e9\\n\\"quoted\\" \\\\ tab\\t!"}'


def read(text: str, cuts: list[int]) -> tuple[ToolOutput, list]:
    output, pieces, last = ToolOutput(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces += output.feed(text[last:cut])
        last = cut
    return output, pieces + output.finish()


def merged(pieces: list) -> list:
    """Pieces with consecutive same-kind pieces joined (token boundaries do not matter)."""
    out: list = []
    for piece in pieces:
        if out and isinstance(piece, Content) and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + piece.text)
        elif out and isinstance(piece, Arguments) and isinstance(out[-1], Arguments) and out[-1].index == piece.index:
            out[-1] = Arguments(piece.index, out[-1].text + piece.text)
        else:
            out.append(piece)
    return out


def splits(text: str, count: int = 60) -> list[list[int]]:
    rng = random.Random(len(text))
    every_char = [list(range(1, len(text)))]
    return every_char + [rng.sample(range(1, len(text)), k=rng.randint(1, 6)) for _ in range(count)]


def test_one_call_any_boundaries():
    for cuts in splits(ONE_CALL):
        output, pieces = read(ONE_CALL, cuts)
        assert merged(pieces) == [
            CallStart(0, "get_weather"),
            Arguments(0, '{"city": "Pa\\"ris \\u00e9", "days": [1, 2], "x": null}'),
        ]
        assert output.done and output.content is None
        [call] = output.calls
        assert json.loads(call.arguments) == {"city": 'Pa"ris é', "days": [1, 2], "x": None}


def test_parallel_calls_in_order():
    for cuts in splits(TWO_CALLS):
        output, pieces = read(TWO_CALLS, cuts)
        assert merged(pieces) == [
            CallStart(0, "a"),
            Arguments(0, "{}"),
            CallStart(1, "b"),
            Arguments(1, '{"x":-1.5e3,"ok":true}'),
        ]
        assert [(c.name, c.arguments) for c in output.calls] == [("a", "{}"), ("b", '{"x":-1.5e3,"ok":true}')]


def test_plain_answer_is_decoded_as_it_comes():
    expected = 'Hello 🎉 wé\n"quoted" \\ tab\t!'
    for cuts in splits(CONTENT):
        output, pieces = read(CONTENT, cuts)
        assert merged(pieces) == [Content(expected)]
        assert output.content == expected and output.calls == [] and output.done
        for piece in pieces:  # never half a surrogate pair
            piece.text.encode("utf-8")


def test_name_after_parameters_waits_for_the_name():
    output, pieces = read('{"parameters": {"q": 1}, "name": "f"}', [5, 20])
    assert pieces == [CallStart(0, "f"), Arguments(0, '{"q": 1}')]
    assert output.calls[0].arguments == '{"q": 1}'


def test_cut_mid_call_lists_only_complete_calls():
    output, pieces = read('[{"name":"a","parameters":{}}, {"name":"b","parameters":{"x":', [10, 40])
    assert [c.name for c in output.calls] == ["a"] and not output.done
    assert merged(pieces)[-1] == Arguments(1, '{"x":')  # streamed so far
    output, _ = read('{"name": "f", "parameters": {"a": 1}', [])
    assert output.calls == [] and output.content is None and not output.done


def test_cut_mid_content_keeps_the_text_so_far():
    output, _ = read('{"content": "Hello wor', [3])
    assert output.content == "Hello wor" and not output.done


def test_text_that_is_not_json_is_the_content():
    output, pieces = read("  Sure, here it is", [1, 5])
    assert output.mode == "text" and output.content == "  Sure, here it is" and output.calls == []
    assert "".join(p.text for p in pieces) == "  Sure, here it is"


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1}}} trailing', '{"name": "f" "x"}'])
def test_broken_json_stops_reading(text):
    output, _ = read(text, [])
    assert not output.done


def test_leading_whitespace_and_number_arguments():
    output, pieces = read('\n {"name": "f", "parameters": 12}', [1, 2])
    assert output.calls[0].arguments == "12" and merged(pieces) == [CallStart(0, "f"), Arguments(0, "12")]
