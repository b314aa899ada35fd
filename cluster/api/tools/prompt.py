"""A tool-calling chat's messages and tools, as its chat template can render them.

A template that renders tools itself (formats.probe_template) gets the request's
`tools` and its history as they came: assistant turns with `tool_calls` (their
arguments as JSON objects, as such templates expect) and `tool` messages. A
template that knows no tools (the trained preset's ChatML) gets the tools in a
system prompt written here, teaching the `<tool_call>` form, and a history it can
render: an assistant's calls as its text in that form, tool results as a user turn
naming the function that returned each (consecutive results in one turn).

`tool_choice: "none"` shows the model no tools (a past call still renders).
"""
from __future__ import annotations

import json

from cluster.api.tools.formats import HERMES, TemplateTools, call_json

TOOL_SYSTEM_PROMPT = """You can call functions to help with the user's request. The functions, one JSON object per line, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <the arguments as a JSON object>}}
</tool_call>
A function's result comes back in a user turn that names it; then answer the user in plain words."""


def chat_for_template(messages: list[dict], tools: list[dict] | None,
                      template: TemplateTools) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the template. `messages`: the request's, as plain dicts
    (role, content text or None, and `tool_calls` / `tool_call_id` where given; a
    developer message already mapped); `tools`: the tools the model may call (None:
    it sees none)."""
    if template.renders_tools:
        return [_native(m) for m in messages], tools
    rendered: list[dict] = []
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    last_was_result = False  # consecutive results share one user turn
    for m in messages:
        if m["role"] == "tool":
            name = names.get(m["tool_call_id"], "the function")
            text = f"{name} returned: {m['content']}"
            if last_was_result:
                rendered[-1]["content"] += "\n" + text
            else:
                rendered.append({"role": "user", "content": text})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{call_json(c['function']['name'], c['function']['arguments'], HERMES)}\n</tool_call>"
                              for c in m["tool_calls"])
            text = m.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            rendered.append({"role": m["role"], "content": m.get("content") or ""})
        last_was_result = m["role"] == "tool"
    if tools:
        prompt = TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _native(m: dict) -> dict:
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _as_object(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _as_object(arguments: str):
    """A replayed call's arguments as the JSON value they spell (templates dump them
    with `tojson`); the text itself where it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
