"""Stop-sequence matching on text, holding back any tail that may be the start of a stop string.

Held-back text is released when it can no longer start a stop string, so streamed token texts
always concatenate to the final generated text, with or without a matched stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop_sequences: list[str], include_stop_str: bool = False) -> None:
        self._stops = [s for s in stop_sequences if s]
        self._include = include_stop_str
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str, match: bool = True) -> tuple[str, bool]:
        """Take new text; return (text safe to emit now, whether a stop string matched). Without `match` (a
        request short of its `min_new_tokens`) no stop string is looked for: vLLM's rule, under which a stop
        string the text completes before then never ends the request, one held back across it still may."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        best: tuple[int, str] | None = None
        for stop in self._stops if match else ():
            i = buf.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            self.matched = stop
            self._pending = ""
            return buf[: i + len(stop)] if self._include else buf[:i], True
        hold = self._longest_stop_prefix_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
