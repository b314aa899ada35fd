"""The grammar (llguidance's Lark) a tool-calling request is held to.

- `required`, or a named tool: the answer is calls only, each a call of one of the
  tools (the named one) whose arguments match its `parameters` schema;
- `auto`: text is free until the format's opener (llguidance's lazy rule: the first
  `<tool_call>` ends the text), then the calls are held as above; with
  `llama3_json`, an answer that starts with `{` is a call;
- `parallel_tool_calls: false`: at most one call.

The engine compiles it as any structured output (checked once at the ingress,
compiled once per text), so a constrained call is always valid JSON for its schema,
and its name always one of the tools. The call object's keys come in the format's
order (name, then arguments), so a stream can send the name before the arguments.
"""
from __future__ import annotations

import json

from cluster.api.tools.formats import ToolFormat

# NOTE: fixed separators, no free whitespace: a sampled model could pad forever
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_schema(name: str, parameters: dict | None, fmt: ToolFormat) -> dict:
    """One tool's call object: its name, then its arguments under the format's key."""
    key = fmt.arguments_keys[0]
    return {"type": "object",
            "properties": {"name": {"const": name}, key: parameters or _EMPTY_PARAMETERS},
            "required": ["name", key], "additionalProperties": False,
            "x-guidance": _JSON_LAYOUT}


def tool_grammar(tools: list[dict], fmt: ToolFormat, *, choice: str | None,
                 parallel: bool) -> str:
    """`tools`: OpenAI's function tools ({"name", "parameters"} under "function");
    `choice`: "auto", "required", or a tool's name (then only that tool)."""
    functions = [t["function"] for t in tools]
    if choice not in ("auto", "required"):
        functions = [f for f in functions if f["name"] == choice]
    rules = [f"call_{i}: %json {json.dumps(call_schema(f['name'], f.get('parameters'), fmt))}"
             for i, f in enumerate(functions)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    free = choice == "auto"
    if fmt.opener:  # tagged calls after any text
        first = f'"\\n" call {json.dumps(fmt.call_close)}'
        more = (f' ({json.dumps(fmt.separator + fmt.call_open)} call {json.dumps(fmt.call_close)})*'
                if parallel else "")
        if free:
            start = ("start: TEXT | head calls\n"
                     f"head[lazy]: TEXT {json.dumps(fmt.opener)}\n"
                     "TEXT: /(.|\\n)*/")
        else:
            start = f"start: {json.dumps(fmt.opener)} calls"
        calls = f"calls: {first}{more}"
    else:  # the answer is text, or calls from its first character
        more = f" ({json.dumps(fmt.separator)} call)*" if parallel else ""
        start = "start: TEXT | calls\nTEXT: /([^{\\s](.|\\n)*)?/" if free else "start: calls"
        calls = f"calls: call{more}"
    return "\n".join(["%llguidance {}", start, calls, call, *rules]) + "\n"
