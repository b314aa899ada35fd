"""Stop strings matched across pushes, with hold-back.

Text that could still be the start of a stop string is held back (at most
`max(len(stop)) - 1` characters) until the next push shows whether it is.
When several stop strings match, the one that ends first in the text wins
(ties: the longer one), so the result never depends on how the text was split.
Work per push is O(len(text) + max stop length) per stop string.
"""
from __future__ import annotations


class StopStringMatcher:
    __slots__ = (
        "_stops", "_include_stop_str", "_proper_prefixes", "_first_chars", "_max_hold",
        "_held", "_matched", "last_match_end",
    )

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stop) if s]  # "" would match everywhere
        self._include_stop_str = include_stop_str_in_output
        self._proper_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._first_chars = {s[0] for s in self._stops}
        self._max_hold = max(map(len, self._stops), default=1) - 1
        # The text's end that could still start a stop string. NOTE: when the stop
        # string is part of the output, this tail is emitted at once (text before a
        # match is output either way) and only kept for matching.
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
        num_old = len(self._held)
        buffer = self._held + text
        match = self._find_first_match(buffer)
        if match is not None:
            start, stop = match
            end = start + len(stop)
            self._matched, self._held = stop, ""
            self.last_match_end = end - num_old
            return (buffer[num_old:end], stop) if self._include_stop_str else (buffer[:start], stop)
        num_held = self._num_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held:] if num_held else ""
        if self._include_stop_str:
            return text, None
        return buffer[:len(buffer) - num_held], None

    def flush(self) -> str:
        """At the finish: the held-back text (it did not become a stop string)."""
        held, self._held = self._held, ""
        return "" if self._include_stop_str else held

    def _find_first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[0] + best[1], best[2])

    def _num_to_hold(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that starts some stop string."""
        first_chars = self._first_chars
        for num_chars in range(min(self._max_hold, len(buffer)), 0, -1):
            if buffer[-num_chars] in first_chars and buffer[-num_chars:] in self._proper_prefixes:
                return num_chars
        return 0
