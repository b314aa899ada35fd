"""A model's answer text -> its content and tool calls, for the text so far.

`parse` is a function of the whole text: the streaming side re-parses each
choice's text every step and sends what grew (cluster/api/tools/stream.py); the
non-streamed answer parses the final text once. What `parse` returns only ever
grows as the text does (content and each call's arguments are prefixes of what a
longer text gives; a call's name appears once, whole), so the deltas a stream sent
join into the non-streamed message exactly, however the text was cut into steps:
- content that could still turn out to be the start of a call (a suffix that may
  begin the opener, trailing whitespace before it) is held back until it cannot;
- a call's arguments are the raw text of its JSON value as generated (no re-dump:
  `{}` stays `{}`, integers stay integers), which belongs to it until it closes;
- a call's name is known once its JSON string is complete.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from cluster.api.tools.formats import PYTHON_TAG, ToolFormat

_WS = " \t\r\n"


@dataclass(slots=True)
class ParsedCall:
    name: str | None = None  # None until its JSON string is complete
    arguments: str = ""  # the raw JSON text of its arguments so far
    complete: bool = False  # its object closed


@dataclass(slots=True)
class ParsedText:
    content: str = ""  # text safe to send as content
    calls: list[ParsedCall] = field(default_factory=list)


def parse(text: str, fmt: ToolFormat, final: bool) -> ParsedText:
    """The content and calls of `text`; `final`: no more text will come."""
    if fmt.opener:
        return _parse_tagged(text, fmt, final)
    return _parse_bare(text, fmt, final)


def _parse_tagged(text: str, fmt: ToolFormat, final: bool) -> ParsedText:
    start = text.find(fmt.opener)
    if start < 0:
        if final:
            return ParsedText(text)
        safe = text[:len(text) - _opener_prefix_len(text, fmt.opener)]
        return ParsedText(safe.rstrip(_WS))
    calls = _tagged_calls(text, start, fmt)
    if final and not any(c.name is not None for c in calls):
        return ParsedText(text)  # an opener and no call after it: it was text
    return ParsedText(text[:start].rstrip(_WS), calls)


def _opener_prefix_len(text: str, opener: str) -> int:
    """The length of the longest suffix of `text` that begins `opener`."""
    for n in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-n:]):
            return n
    return 0


def _tagged_calls(text: str, pos: int, fmt: ToolFormat) -> list[ParsedCall]:
    open_tag, close_tag = fmt.call_open.strip(_WS), fmt.call_close.strip(_WS)
    calls: list[ParsedCall] = []
    while True:
        pos = _skip_ws(text, pos)
        if not text.startswith(open_tag, pos):
            return calls  # the end of the text, or text after the calls: not a call
        pos = _skip_ws(text, pos + len(open_tag))
        call, pos = _call_object(text, pos, fmt)
        if call is None:
            return calls
        calls.append(call)
        if not call.complete:
            return calls
        pos = _skip_ws(text, pos)
        if not text.startswith(close_tag, pos):
            return calls
        pos += len(close_tag)


def _parse_bare(text: str, fmt: ToolFormat, final: bool) -> ParsedText:
    pos = _skip_ws(text, 0)
    rest = text[pos:]
    if rest.startswith(PYTHON_TAG):
        pos = _skip_ws(text, pos + len(PYTHON_TAG))
    elif PYTHON_TAG.startswith(rest) and not final:
        return ParsedText()  # nothing but whitespace, or the tag's first characters
    if pos >= len(text):
        return ParsedText(text if final else "")  # the tag, and nothing after it yet
    if text[pos] != "{":
        return ParsedText(text)
    calls: list[ParsedCall] = []
    separator = fmt.separator.strip(_WS)
    while True:
        call, pos = _call_object(text, pos, fmt)
        if call is None:
            break
        calls.append(call)
        if not call.complete:
            break
        pos = _skip_ws(text, pos)
        if not text.startswith(separator, pos):
            break
        pos = _skip_ws(text, pos + len(separator))
    if final and not any(c.name is not None for c in calls):
        return ParsedText(text)  # JSON, but no call
    return ParsedText("", calls)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _call_object(text: str, pos: int, fmt: ToolFormat) -> tuple[ParsedCall | None, int]:
    """The call whose object starts at `pos`, and where it ended; None where the text
    there is not a call object (so far)."""
    if pos >= len(text):
        return ParsedCall(), pos  # not begun: an empty call so far
    if text[pos] != "{":
        return None, pos
    call = ParsedCall()
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return call, pos
        if text[pos] == "}":
            call.complete = True
            return call, pos + 1
        if text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            if pos >= len(text):
                return call, pos
        if text[pos] != '"':
            return None, pos
        key_end, key_done = _value_end(text, pos)
        if not key_done:
            return call, len(text)
        key = json.loads(text[pos:key_end])
        pos = _skip_ws(text, key_end)
        if pos >= len(text):
            return call, pos
        if text[pos] != ":":
            return None, pos
        value_start = _skip_ws(text, pos + 1)
        if value_start >= len(text):
            return call, value_start
        value_end, value_done = _value_end(text, value_start)
        if key in fmt.arguments_keys:
            call.arguments = text[value_start:value_end]
        elif key == "name" and value_done and text[value_start] == '"':
            call.name = json.loads(text[value_start:value_end])
        if not value_done:
            return call, len(text)
        pos = value_end


def _value_end(text: str, pos: int) -> tuple[int, bool]:
    """Where the JSON value at `pos` ends, and whether it is whole (else: the text's end)."""
    first = text[pos]
    if first == '"':
        i = pos + 1
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == '"':
                return i + 1, True
            i += 1
        return len(text), False
    if first in "{[":
        depth, i, in_string = 0, pos, False
        while i < len(text):
            c = text[i]
            if in_string:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1, True
            i += 1
        return len(text), False
    # a number or a literal: whole once something follows it
    i = pos
    while i < len(text) and text[i] not in _WS + ",}]":
        i += 1
    return i, i < len(text)
