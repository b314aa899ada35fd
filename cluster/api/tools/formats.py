"""The text a model writes a tool call in, and which one a chat template speaks.

Two families are parsed:
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after
  any text (Qwen2/2.5/3, Hermes, and the format this server teaches a template that
  knows no tools);
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (calls
  joined by `; `), optionally after `<|python_tag|>` (Llama 3.1+).

A template is probed once, when the ingress starts, by rendering a dummy tool and a
dummy call: no list of model names to keep. A template that renders no tools, or
renders them in a form not parsed here (Mistral's `[TOOL_CALLS]`), gets the tools
from this server's system prompt and the `hermes` form (cluster/api/tools/prompt.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    # Text that opens the calls; "" where the answer itself starts with a call.
    opener: str
    # Text that opens and closes each call (hermes), "" where calls are bare objects.
    call_open: str
    call_close: str
    # What separates two calls outside any tags.
    separator: str
    # The call object's keys for the arguments (the first one is what is generated).
    arguments_keys: tuple[str, ...]


HERMES = ToolFormat("hermes", opener="<tool_call>", call_open="<tool_call>\n",
                    call_close="\n</tool_call>", separator="\n", arguments_keys=("arguments",))
LLAMA3_JSON = ToolFormat("llama3_json", opener="", call_open="", call_close="", separator="; ",
                         arguments_keys=("parameters", "arguments"))
# Llama 3's marker before a call: a special token, which a decode that skips them drops.
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class TemplateTools:
    """How a chat template takes tools: `renders_tools` (its own rendering of the
    `tools` and of past calls is used) and the format its model answers in."""

    renders_tools: bool
    format: ToolFormat


_PROBE_NAME = "stepstream_probe_tool"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {
        "type": "object", "properties": {"probe_arg": {"type": "integer"}}}}}
_PROBE_CALL = {"id": "call_probe", "type": "function",
               "function": {"name": _PROBE_NAME, "arguments": {"probe_arg": 7}}}


def probe_template(render) -> TemplateTools:
    """`render(messages, tools) -> str` is the tokenizer's template (raising when it
    rejects a chat). Does the template show a tool, and in which form does it write
    a past call?"""
    user = {"role": "user", "content": "hi"}
    try:
        shown = render([user], [_PROBE_TOOL])
    except Exception:
        return TemplateTools(False, HERMES)
    if _PROBE_NAME not in shown:
        return TemplateTools(False, HERMES)
    try:
        history = render([user, {"role": "assistant", "content": "",
                                 "tool_calls": [_PROBE_CALL]}], [_PROBE_TOOL])
    except Exception:
        return TemplateTools(False, HERMES)
    call_text = history[len(_common_prefix(shown, history)):]
    if "<tool_call>" in call_text:
        return TemplateTools(True, HERMES)
    if '"parameters"' in call_text and _PROBE_NAME in call_text and "[TOOL_CALLS]" not in call_text:
        return TemplateTools(True, LLAMA3_JSON)
    return TemplateTools(False, HERMES)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def call_json(name: str, arguments: str, fmt: ToolFormat) -> str:
    """A call written the way `fmt`'s model writes it (a replayed turn's text)."""
    return f'{{"name": {json.dumps(name)}, "{fmt.arguments_keys[0]}": {arguments}}}'
