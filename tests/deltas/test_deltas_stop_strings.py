"""StopStringMatcher: matches across pushes, holds back only what could start a stop."""
from __future__ import annotations

import sys
import time
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from deltas.stop_strings import StopStringMatcher


def run(stops: list[str], pieces: list[str], include: bool = False) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted = []
    for piece in pieces:
        text, stop = matcher.push(piece)
        emitted.append(text)
        if stop is not None:
            return emitted, stop
    emitted.append(matcher.flush())
    return emitted, None


def reference(stops: list[str], text: str, include: bool) -> tuple[str, str | None]:
    """The stop string that ends first (ties: the longer one), on the whole text."""
    best = None
    for stop in stops:
        start = text.find(stop) if stop else -1
        if start >= 0:
            key = (start + len(stop), -len(stop))
            if best is None or key < best[0]:
                best = (key, start, stop)
    if best is None:
        return text, None
    _, start, stop = best
    return (text[:start + len(stop)] if include else text[:start]), stop


def test_stop_string_spanning_several_pushes():
    emitted, stop = run(["STOP"], ["hello S", "T", "O", "P and more"])
    assert "".join(emitted) == "hello " and stop == "STOP"
    assert emitted[0] == "hello "  # "S" held back
    assert emitted[1:] == ["", "", ""]


def test_overlapping_prefix():
    emitted, stop = run(["abc"], ["a", "a", "b", "c"])
    assert "".join(emitted) == "a" and stop == "abc"
    assert emitted == ["", "a", "", ""]  # the first "a" is released once "aa" shows it is no match start
    emitted, stop = run(["abc"], ["aabc"])
    assert emitted == ["a"]


def test_include_stop_string_in_output():
    emitted, stop = run(["abc"], ["xa", "ab", "cd"], include=True)
    assert "".join(emitted) == "xaabc" and stop == "abc"
    assert emitted[0] == "xa"  # nothing is held back when the stop string is output anyway


def test_exclude_stop_string_holds_back():
    emitted, _ = run(["abc"], ["xa", "ab", "cd"])
    assert emitted == ["x", "a", ""]


def test_multiple_stops_first_ending_wins():
    assert run(["world", "lo w"], ["hello world"])[1] == "lo w"
    assert run(["bcd", "abcd"], ["xabcd"]) == (["x"], "abcd")  # same end: the longer one
    assert run(["cd", "b"], ["abcd"]) == (["a"], "b")


def test_held_text_flushed_at_the_finish():
    emitted, stop = run(["</answer>"], ["the end </ans"])
    assert stop is None
    assert emitted == ["the end ", "</ans"]


def test_holds_only_possible_stop_starts():
    matcher = StopStringMatcher(["xyz"])
    assert matcher.push("hello x") == ("hello ", None)
    assert matcher.push("q") == ("xq", None)
    assert matcher.push("yy") == ("yy", None)


def test_push_after_match_is_a_no_op():
    matcher = StopStringMatcher(["."])
    assert matcher.push("a. b") == ("a", ".")
    assert matcher.push("more") == ("", None)
    assert matcher.flush() == ""
    assert matcher.matched == "."


def test_empty_stop_strings_are_ignored():
    assert run(["", "z"], ["abc"]) == (["abc", ""], None)
    assert run([""], ["abc"]) == (["abc", ""], None)


def test_last_match_end_is_relative_to_the_last_push():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xxab") == ("xx", None)
    assert matcher.push("cyy") == ("", "abc")
    assert matcher.last_match_end == 1


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30)),
    include=st.booleans(),
)
def test_any_split_matches_the_whole_text_reference(text, stops, cuts, include):
    pieces = _split(text, cuts)
    emitted, stop = run(stops, pieces, include)
    expected_text, expected_stop = reference(stops, text, include)
    assert ("".join(emitted), stop) == (expected_text, expected_stop)
    # never holds more than max(len) - 1 characters
    matcher = StopStringMatcher(stops, include)
    num_emitted = 0
    for num_pushed, piece in enumerate(pieces, 1):
        out, found = matcher.push(piece)
        num_emitted += len(out)
        if found:
            break
        if not include:
            assert sum(map(len, pieces[:num_pushed])) - num_emitted <= max(map(len, stops)) - 1


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab", max_size=60),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=12), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 60)),
    include=st.booleans(),
)
def test_periodic_stops_fall_back_correctly(text, stops, cuts, include):
    # Two letters make long self-overlapping stop strings, where matching must fall
    # back to the longest border of what matched, not to the start.
    pieces = _split(text, cuts)
    emitted, stop = run(stops, pieces, include)
    assert ("".join(emitted), stop) == reference(stops, text, include)


def _worst_accepted_stops() -> list[str]:
    """As many stop strings as the ingress accepts, each as long as it accepts, of
    characters stored 4 bytes each, self-overlapping (each is one repeated
    character) and with no prefix in common."""
    from cluster.api.openai_protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    return [chr(0x1F600 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]


def test_state_is_bounded_by_the_stop_strings_size():
    stops = _worst_accepted_stops()
    stops_size = sum(sys.getsizeof(s) for s in stops)
    num_held = len(stops[0]) - 1
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        matcher = StopStringMatcher(stops)
        for _ in range(num_held):  # the longest hold-back there is
            assert matcher.push(stops[0][0]) == ("", None)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    state_size = sum(s.size_diff for s in after.compare_to(before, "filename"))
    # NOTE: 2 bytes of failure table per stop character, the held text and small
    # change; a set of every prefix made 9.6 MB here (280x the stop strings).
    assert state_size <= 2 * stops_size, (state_size, stops_size)
    assert matcher.push("x") == (stops[0][:num_held] + "x", None)


def test_construction_of_the_worst_stop_list_is_fast():
    stops = _worst_accepted_stops()
    fastest_s = min(_seconds(lambda: StopStringMatcher(stops)) for _ in range(5))
    assert fastest_s < 0.005, fastest_s


def test_adversarial_pushes_cost_linear_time():
    # Each push makes every stop string fall back along its whole border chain
    # at worst once per character pushed (amortized KMP), never per held prefix.
    stops = [("a" * 511)[:511 - i] + "b" for i in range(8)]
    stops += [("a" * 255)[:255 - i] + "c" + "a" * 255 for i in range(8)]
    matcher = StopStringMatcher(stops)
    elapsed_s = _seconds(lambda: [matcher.push("a") for _ in range(10_000)])
    assert elapsed_s < 1.0, elapsed_s  # ~0.06 s; a rescan of every held prefix: minutes


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
