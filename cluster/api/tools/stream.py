"""One choice's answer as OpenAI's tool-calling deltas and message.

`ToolCallStream` (one per choice: the `n` choices never share parser state) takes
the choice's text deltas, however many tokens each holds, re-parses the whole text
so far (cluster/api/tools/parser.py) and returns what grew as one chunk's `delta`
fields: content, then per call its first entry (`index`, `id`, `type`, `name`, the
arguments so far) and later entries with argument fragments only. `tool_message`
is the non-streamed message of a final text: the same parse, so the fragments a
stream sent join into its `arguments`.
"""
from __future__ import annotations

import uuid

from cluster.api.tools.formats import ToolFormat
from cluster.api.tools.parser import parse


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, made_calls: bool, named: bool) -> str | None:
    """A finished choice that made calls ends with "tool_calls"; with a named
    tool_choice "stop", as OpenAI answers it. A cut ("length") stays a cut."""
    if reason == "stop" and made_calls and not named:
        return "tool_calls"
    return reason


class ToolCallStream:
    __slots__ = ("_format", "_text", "_content_sent", "_calls_sent")

    def __init__(self, fmt: ToolFormat) -> None:
        self._format = fmt
        self._text = ""
        self._content_sent = 0
        self._calls_sent: list[list] = []  # per call: [id, argument characters sent]

    @property
    def made_calls(self) -> bool:
        return bool(self._calls_sent)

    def feed(self, text: str, final: bool) -> dict:
        """The `delta` fields for the text that came (and, `final`, the rest held back):
        `content` and/or `tool_calls`; empty when nothing can be sent yet."""
        self._text += text
        parsed = parse(self._text, self._format, final)
        delta: dict = {}
        if len(parsed.content) > self._content_sent:
            delta["content"] = parsed.content[self._content_sent:]
            self._content_sent = len(parsed.content)
        entries = []
        for index, call in enumerate(parsed.calls):
            entry = None
            if index == len(self._calls_sent):
                if call.name is None:
                    break  # its header needs its name: nothing of it before that
                call_id = new_call_id()
                self._calls_sent.append([call_id, 0])
                entry = {"index": index, "id": call_id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            sent = self._calls_sent[index]
            fragment = call.arguments[sent[1]:]
            if fragment:
                sent[1] = len(call.arguments)
                if entry is None:
                    entry = {"index": index, "function": {"arguments": fragment}}
                else:
                    entry["function"]["arguments"] = fragment
            if entry is not None:
                entries.append(entry)
        if entries:
            delta["tool_calls"] = entries
        return delta


def tool_message(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a choice's final text: content None where calls
    were made and no text came before them."""
    parsed = parse(text, fmt, final=True)
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}
             for call in parsed.calls if call.name is not None]
    if not calls:
        return parsed.content, []
    return parsed.content or None, calls


class ToolAnswers:
    """What a tool-calling request's answers are read with: one stream per choice,
    the message of a final text, the finish reason of a choice."""

    __slots__ = ("format", "named")

    def __init__(self, fmt: ToolFormat, named: bool) -> None:
        self.format = fmt
        self.named = named  # tool_choice named a function: its finish is "stop"

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.format)

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        return tool_message(text, self.format)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        return finish_reason(reason, made_calls, self.named)
