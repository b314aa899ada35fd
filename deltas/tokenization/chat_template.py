"""Render HF chat templates (jinja2, sandboxed) the way transformers does.

Same environment as transformers' `apply_chat_template`: trim_blocks,
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text, and the
`raise_exception` / `strftime_now` helpers. `{% generation %}` blocks (used by
transformers to mark assistant tokens) render their body unchanged.

`mask_special_text` / `unmask_special_text` let a tokenizer tell the template's
own special tokens from special-token text that a chat's messages hold.
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # NOTE: jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """`special_tokens` (bos_token, eos_token, ...) are template variables."""
    template = compile_chat_template(source)
    variables = {**special_tokens, **template_kwargs}
    return template.render(
        messages=messages, tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, **variables,
    )


# NOTE: private-use characters and digits: no template filter (trim, upper, ...)
# or normalizer changes them, so a marker comes out of the render as it went in.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def mask_special_text(value: Any, pattern: re.Pattern[str], nonce: str, hidden: list[str]) -> Any:
    """`value` (messages or tools: nested dicts, lists, strings) with each match of
    `pattern` in a string replaced by a marker; the matched texts go to `hidden`.

    Only the strings' own matches are seen: special-token text made by joining two
    strings (or a string and template text) is not, as the ingress passes one string
    per message."""
    if isinstance(value, str):
        def hide(match: re.Match[str]) -> str:
            hidden.append(match.group())
            return f"{_MARK_OPEN}{nonce}.{len(hidden) - 1}{_MARK_CLOSE}"
        return pattern.sub(hide, value)
    if isinstance(value, dict):
        return {key: mask_special_text(item, pattern, nonce, hidden) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_special_text(item, pattern, nonce, hidden) for item in value]
    return value


def unmask_special_text(text: str, nonce: str, hidden: list[str]) -> str:
    """`text` with `mask_special_text`'s markers back to the texts they hid."""
    marker = re.compile(re.escape(f"{_MARK_OPEN}{nonce}.") + r"(\d+)" + re.escape(_MARK_CLOSE))
    return marker.sub(lambda match: hidden[int(match.group(1))], text)
