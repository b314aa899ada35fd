"""Stop strings matched across pushes, with hold-back.

Text that could still be the start of a stop string is held back (at most
`max(len(stop)) - 1` characters) until the next push shows whether it is.
When several stop strings match, the one that ends first in the text wins
(ties: the longer one), so the result never depends on how the text was split.

Each stop string is matched as a stream (Knuth-Morris-Pratt): its state is how
many of its first characters the text so far ends with, and its failure table
says where to fall back on a mismatch. So the matcher keeps O(total stop length)
small integers, whatever the stop strings hold (a set of every prefix would be
quadratic: megabytes for 16 stop strings of 512 characters), and the held-back
text is the longest of those matched prefixes. Work per push is
O(len(text) + max stop length) per stop string; a stop string whose state is 0
skips to its first character's next occurrence with `str.find`.
"""
from __future__ import annotations

from array import array


class StopStringMatcher:
    __slots__ = (
        "_stops", "_first_chars", "_fallbacks", "_num_matched", "_include_stop_str",
        "_held", "_matched", "last_match_end",
    )

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stop) if s]  # "" would match everywhere
        self._first_chars = [s[0] for s in self._stops]
        self._fallbacks = [_failure_table(s) for s in self._stops]
        # per stop string: how many of its first characters the text so far ends with
        self._num_matched = [0] * len(self._stops)
        self._include_stop_str = include_stop_str_in_output
        # The text's end that could still start a stop string. NOTE: when the stop
        # string is part of the output, text is emitted at once (text before a match
        # is output either way) and the per-stop states alone carry the matching.
        self._held = ""
        self._matched: str | None = None
        # offset in the last pushed text just past the matched stop string
        self.last_match_end = -1

    @property
    def matched(self) -> str | None:
        return self._matched

    def push(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, matched stop string or None). After a match: a no-op."""
        if self._matched is not None or not text:
            return "", None
        stops, first_chars, num_matched = self._stops, self._first_chars, self._num_matched
        best_end, best_stop = -1, ""
        for index, stop in enumerate(stops):
            if not num_matched[index] and first_chars[index] not in text:
                continue  # the common case, without a call
            state, end = _advance(stop, self._fallbacks[index], num_matched[index], text)
            num_matched[index] = state
            if end >= 0 and (best_end < 0 or end < best_end
                             or (end == best_end and len(stop) > len(best_stop))):
                best_end, best_stop = end, stop
        if best_end >= 0:
            return self._finish(text, best_end, best_stop), best_stop
        if self._include_stop_str:
            return text, None
        buffer = self._held + text
        num_held = max(num_matched, default=0)
        self._held = buffer[len(buffer) - num_held:] if num_held else ""
        return buffer[:len(buffer) - num_held], None

    def flush(self) -> str:
        """At the finish: the held-back text (it did not become a stop string)."""
        held, self._held = self._held, ""
        return "" if self._include_stop_str else held

    def _finish(self, text: str, end: int, stop: str) -> str:
        """The text to emit when `stop` ends at offset `end` of `text`."""
        self._matched, self.last_match_end = stop, end
        held, self._held = self._held, ""
        if self._include_stop_str:
            return text[:end]
        # NOTE: the match may start inside the held-back text.
        return (held + text)[:len(held) + end - len(stop)]


def _failure_table(stop: str) -> array:
    """[k]: the length of the longest proper prefix of stop[:k + 1] that is also
    its suffix (where matching falls back to after a mismatch)."""
    table = array("H" if len(stop) <= 0xFFFF else "L", [0]) * len(stop)
    num_matched = 0
    for k in range(1, len(stop)):
        char = stop[k]
        while num_matched and stop[num_matched] != char:
            num_matched = table[num_matched - 1]
        if stop[num_matched] == char:
            num_matched += 1
        table[k] = num_matched
    return table


def _advance(stop: str, fallback: array, num_matched: int, text: str) -> tuple[int, int]:
    """Feed `text` to one stop string's matcher in state `num_matched`: (the new
    state, the offset in `text` just past the first full match or -1)."""
    first, num_chars, num_text = stop[0], len(stop), len(text)
    pos = 0
    while pos < num_text:
        if not num_matched:
            pos = text.find(first, pos)
            if pos < 0:
                return 0, -1
            num_matched = 1
        else:
            char = text[pos]
            while num_matched and stop[num_matched] != char:
                num_matched = fallback[num_matched - 1]
            if stop[num_matched] == char:
                num_matched += 1
        pos += 1
        if num_matched == num_chars:
            return num_matched, pos
    return num_matched, -1
