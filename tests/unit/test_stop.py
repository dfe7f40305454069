"""Stop-string matching (StopMatcher) and the rules that end a sequence (Sequence.on_token).

Invariant checked throughout: the texts of a sequence's token events concatenate to its
``finish.generated_text``, whatever ended it and whatever was held back on the way.
"""

from __future__ import annotations

import pytest
from fakes import EOS, ByteTokenizer, FakeTokenizer, feed, make_seq

from lmiserve.core.events import FinishReason
from lmiserve.engine.text.stop import StopMatcher

# --- StopMatcher --------------------------------------------------------------------------------


def test_without_stop_strings_text_passes_through():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.flush() == "" and m.matched is None


def test_empty_stop_strings_are_ignored():
    m = StopMatcher(["", ""])
    assert m.feed("abc") == ("abc", False)


def test_holds_back_a_possible_stop_prefix_then_matches():
    m = StopMatcher(["world"])
    assert m.feed("Hello wo") == ("Hello ", False)
    assert m.feed("rl") == ("", False)
    assert m.feed("d! more") == ("", True)
    assert m.matched == "world"
    assert m.flush() == ""


def test_releases_held_text_when_it_cannot_start_a_stop():
    m = StopMatcher(["world"])
    assert m.feed("wo") == ("", False)
    assert m.feed("nder") == ("wonder", False)
    assert m.flush() == ""


def test_partial_release_keeps_only_the_longest_possible_prefix():
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)  # "aa" may start "aab"
    assert m.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start it
    assert m.feed("b") == ("", True)
    assert m.matched == "aab"


def test_match_inside_one_chunk_drops_everything_after_it():
    m = StopMatcher(["\n"])
    assert m.feed("line one\nline two") == ("line one", True)


def test_earliest_match_wins_among_several_stops():
    m = StopMatcher(["cd", "b"])
    assert m.feed("abcd") == ("a", True)
    assert m.matched == "b"
    m = StopMatcher(["bcd", "abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("cd") == ("", True)  # "abc" starts at 0, before "bcd" at 1
    assert m.matched == "abc"


def test_include_stop_string_keeps_it_but_nothing_after():
    m = StopMatcher(["world"], include_stop_str=True)
    assert m.feed("Hello wo") == ("Hello ", False)
    assert m.feed("rld and more") == ("world", True)


def test_flush_returns_held_back_text_once():
    m = StopMatcher(["###"])
    assert m.feed("answer #") == ("answer ", False)
    assert m.feed("#") == ("", False)
    assert m.flush() == "##"
    assert m.flush() == ""
    assert m.matched is None


def test_held_back_text_across_several_stops_uses_the_longest_candidate():
    m = StopMatcher(["xyz", "yzw"])
    assert m.feed("ayz") == ("a", False)  # "yz" may start "yzw" (and "xyz" cannot)
    assert m.feed("q") == ("yzq", False)


# --- Sequence.on_token: finish reasons -------------------------------------------------------------

TEXTS = {20: "Hel", 21: "lo ", 22: "wor", 23: "ld", 24: "!", 25: " x", 26: "#", 27: "\n"}


def seq_with(**params):
    return make_seq([1, 20], tokenizer=FakeTokenizer(TEXTS), **params)


def check_concat(events):
    fin = events[-1].finish
    assert fin is not None
    assert all(e.finish is None for e in events[:-1])
    assert "".join(e.token.text for e in events if e.token) == fin.generated_text
    assert fin.generated_tokens == len(events)
    return fin


def test_eos_token_ends_and_is_the_last_token_with_empty_text():
    s = seq_with(max_new_tokens=10)
    events = feed(s, [20, 21, EOS, 22])
    assert len(events) == 3
    fin = check_concat(events)
    assert fin.reason is FinishReason.EOS_TOKEN
    assert s.output_ids == [20, 21, EOS]
    assert events[-1].token.id == EOS and events[-1].token.text == "" and events[-1].token.special
    assert fin.generated_text == "Hello "
    assert fin.prompt_tokens == 2 and fin.prompt == "<s>Hel" and fin.error is None
    assert fin.prefill is None
    assert s.finished


def test_eos_text_is_left_out_unless_asked_even_without_skip_special_tokens():
    # vLLM's: EOS is a stop token, its text is not output (a tool parser reading special tokens never sees it)
    s = seq_with(skip_special_tokens=False)
    fin = check_concat(feed(s, [20, EOS]))
    assert fin.reason is FinishReason.EOS_TOKEN and fin.generated_text == "Hel"
    s = seq_with(skip_special_tokens=False, include_stop_str_in_output=True)
    fin = check_concat(feed(s, [20, EOS]))
    assert fin.reason is FinishReason.EOS_TOKEN and fin.generated_text == "Hel</s>"


def test_ignore_eos_token_generates_through_eos_until_length():
    s = seq_with(ignore_eos_token=True, max_new_tokens=4)
    events = feed(s, [20, EOS, 21, EOS, 22])
    assert len(events) == 4
    fin = check_concat(events)
    assert fin.reason is FinishReason.LENGTH
    assert s.output_ids == [20, EOS, 21, EOS]
    assert fin.generated_text == "Hello "


def test_min_new_tokens_is_not_enforced_here():
    # The runner bans EOS/stop ids while fewer than min_new_tokens were generated; on_token just obeys EOS.
    s = seq_with(min_new_tokens=5)
    fin = check_concat(feed(s, [20, EOS]))
    assert fin.reason is FinishReason.EOS_TOKEN and fin.generated_tokens == 2


def test_stop_strings_are_looked_for_only_past_min_new_tokens():
    """vLLM's rule (its detokenizer checks stop strings once the output is longer than min_tokens): a stop
    string completed within the first `min_new_tokens` tokens is passed, never found later; one the text
    completes after them ends the request, also where its start was held back before."""
    early = check_concat(feed(seq_with(stop_sequences=["l"], min_new_tokens=3), [20, 21, 22, 23, 24]))
    assert early.reason is FinishReason.STOP_SEQUENCE and early.generated_text == "Hello wor"
    assert early.generated_tokens == 4 and early.stop_reason == "l"
    assert check_concat(feed(seq_with(stop_sequences=["l"]), [20, 21])).generated_text == "He"
    across = check_concat(feed(seq_with(stop_sequences=["o w"], min_new_tokens=2), [20, 21, 22, 23]))
    assert across.reason is FinishReason.STOP_SEQUENCE and across.generated_text == "Hell"
    never = check_concat(feed(seq_with(stop_sequences=["Hel"], min_new_tokens=1, max_new_tokens=3), [20, 21, 22]))
    assert never.reason is FinishReason.LENGTH and never.generated_text == "Hello wor"


def test_a_stop_string_is_not_matched_without_match_but_its_start_is_held():
    m = StopMatcher(["ab"])
    assert m.feed("xab", match=False) == ("xab", False)
    assert m.feed("cd") == ("cd", False)  # the "ab" before is not looked at again
    assert m.feed("za", match=False) == ("z", False)
    assert m.feed("b!") == ("", True) and m.matched == "ab"


def test_length_ends_after_max_new_tokens():
    s = seq_with(max_new_tokens=3)
    events = feed(s, [20, 21, 22, 23])
    fin = check_concat(events)
    assert fin.reason is FinishReason.LENGTH and fin.generated_text == "Hello wor"


def test_stop_token_id_ends_with_stop_sequence_and_leaves_its_text_out():
    s = seq_with(stop_token_ids=[24])
    events = feed(s, [20, 21, 24, 22])
    fin = check_concat(events)
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.stop_reason == 24
    assert s.output_ids == [20, 21, 24] and fin.generated_text == "Hello "  # vLLM's: the token's text is out
    assert events[-1].token.id == 24 and events[-1].token.text == "" and fin.generated_tokens == 3


def test_stop_token_id_text_kept_when_asked():
    s = seq_with(stop_token_ids=[24], include_stop_str_in_output=True)
    events = feed(s, [20, 21, 24, 22])
    fin = check_concat(events)
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "Hello !"
    assert events[-1].token.text == "!"


def test_eos_that_is_also_a_stop_token_id_is_an_eos():
    s = seq_with(stop_token_ids=[EOS, 24])
    fin = check_concat(feed(s, [20, EOS]))
    assert fin.reason is FinishReason.EOS_TOKEN and fin.stop_reason is None


def test_stop_token_id_left_out_still_flushes_held_back_text():
    s = seq_with(stop_sequences=["##!"], stop_token_ids=[24])
    events = feed(s, [20, 26, 26, 24])
    assert [e.token.text for e in events] == ["Hel", "", "", "##"]  # "##" held back, then released
    fin = check_concat(events)
    assert (fin.reason, fin.stop_reason, fin.generated_text) == (FinishReason.STOP_SEQUENCE, 24, "Hel##")


def test_stop_string_spanning_tokens_is_removed():
    s = seq_with(stop_sequences=["o w"])
    events = feed(s, [20, 21, 22, 23])
    assert [e.token.text for e in events] == ["Hel", "l", ""]
    fin = check_concat(events)
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "Hell"
    assert fin.generated_tokens == 3


def test_stop_string_included_when_asked():
    s = seq_with(stop_sequences=["o w"], include_stop_str_in_output=True)
    events = feed(s, [20, 21, 22, 23])
    fin = check_concat(events)
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "Hello w"


def test_held_back_prefix_that_is_not_a_stop_is_released():
    s = seq_with(stop_sequences=["lo!"], max_new_tokens=5)
    events = feed(s, [20, 21, 22, 23, 25])
    assert [e.token.text for e in events] == ["He", "llo ", "wor", "ld", " x"]
    fin = check_concat(events)
    assert fin.reason is FinishReason.LENGTH and fin.generated_text == "Hello world x"


@pytest.mark.parametrize(
    ("ending", "reason"),
    [([EOS], FinishReason.EOS_TOKEN), ([24], FinishReason.STOP_SEQUENCE), ([], FinishReason.LENGTH)],
)
def test_held_back_text_is_flushed_when_the_sequence_ends_otherwise(ending, reason):
    s = seq_with(stop_sequences=["###"], stop_token_ids=[24], max_new_tokens=3 + len(ending))
    events = feed(s, [20, 26, 26, *ending])
    assert events[1].token.text == ""  # "#" held back
    if ending:
        assert events[2].token.text == ""  # "##" still held back
    fin = check_concat(events)
    assert fin.reason is reason
    assert fin.generated_text == "Hel##"  # a stop token id's own text is left out


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop():
    s = seq_with(stop_sequences=["ld"], max_new_tokens=4)
    fin = check_concat(feed(s, [20, 21, 22, 23]))
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "Hello wor"


def test_earliest_of_several_stop_strings():
    s = seq_with(stop_sequences=["world", "lo"], max_new_tokens=10)
    fin = check_concat(feed(s, [20, 21, 22, 23]))
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "Hel"


def test_abort_and_error_end_without_token_keeping_emitted_text():
    s = seq_with(stop_sequences=["###"])
    events = feed(s, [20, 26])
    ev = s.end(FinishReason.ERROR, "boom")
    assert ev.token is None and ev.finish.reason is FinishReason.ERROR and ev.finish.error == "boom"
    assert ev.finish.generated_text == "".join(e.token.text for e in events) == "Hel"
    assert ev.finish.generated_tokens == 2 and s.finished


def test_cumulative_logprob_and_top_tokens():
    s = seq_with()
    ev = s.on_token(20, -0.5, [(20, -0.5), (EOS, -1.5)])
    s.on_token(21, -0.25)
    assert s.cumulative_logprob == pytest.approx(-0.75)
    assert [(t.id, t.text, t.logprob, t.special) for t in ev.top_tokens] == [
        (20, "Hel", -0.5, False),
        (EOS, "</s>", -1.5, True),
    ]


# --- multi-byte characters split across tokens ---------------------------------------------------


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def test_multibyte_characters_split_across_tokens_concatenate_exactly():
    text = "né 日本 🎉!"
    tok, ids = ByteTokenizer.for_text(text, _bytewise)
    s = make_seq([ids[0]], tokenizer=tok, max_new_tokens=len(ids))
    events = feed(s, [*ids[1:], EOS])
    fin = check_concat(events)
    assert fin.reason is FinishReason.EOS_TOKEN
    assert fin.generated_text == text[1:]
    assert all("\ufffd" not in e.token.text for e in events)
    assert sum(1 for e in events if e.token.text == "") >= 8  # continuation bytes held back


def test_stop_string_after_a_multibyte_character():
    text = "日本語です。終わり"
    tok, ids = ByteTokenizer.for_text(text, lambda b: [b[i : i + 2] for i in range(0, len(b), 2)])
    s = make_seq([EOS - 1], tokenizer=tok, stop_sequences=["。"], max_new_tokens=50)
    fin = check_concat(feed(s, ids))
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.generated_text == "日本語です"


def test_incomplete_character_at_length_is_flushed_as_replacement():
    tok, ids = ByteTokenizer.for_text("a日", _bytewise)
    s = make_seq([1], tokenizer=tok, max_new_tokens=3)
    events = feed(s, ids[:3])  # "a" + two of the three bytes of 日
    fin = check_concat(events)
    assert fin.reason is FinishReason.LENGTH
    assert fin.generated_text == "a\ufffd"
