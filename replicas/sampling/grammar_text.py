"""A structured output's grammar text: converted and checked once, where a request enters.

`SamplingParams` checks a spec's shape only. Here its grammar (a JSON schema, a
regex, a choice list or a Lark grammar) becomes llguidance's grammar text, and
llguidance itself checks it: in Rust, with the GIL released, refusing exactly
what the engine could not compile (a metaschema check in Python held the event
loop 2.3 s for a 770 KB schema; llguidance takes 0.6 s in a worker thread).

The ingress checks each request's spec once (`GrammarChecks`), off its event
loop, bounded in size (`MAX_GRAMMAR_CHARS`) and time (`CHECK_TIMEOUT_S`), and
sends `{"llguidance": text}` on: its `n` choices share that one text, and engine
replicas compile it keyed by the text (replicas/sampling/structured_output.py),
never converting or checking it again. Torch-free: the ingress imports it.
"""
from __future__ import annotations

import json
import uuid

from replicas.config import InvalidValue
from replicas.sampling.compile_lanes import CompileLanes, LanesBusy, TooSlow

CHECKED_KIND = "llguidance"
# A grammar's text at most (about a schema's JSON size): llguidance checks a 1 MB
# schema in about a second, and its compile against a vocabulary takes as long.
MAX_GRAMMAR_CHARS = 1024 * 1024
CHECK_TIMEOUT_S = 10.0
# NOTE: compact JSON: with flexible whitespace a sampled model may pad forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
_PARAM = "structured_output"


def grammar_text(spec: dict) -> str:
    """llguidance's grammar text of a spec whose shape is checked; not checked itself."""
    import llguidance as llg
    (key, value), = spec.items()
    if key == CHECKED_KIND:
        return value
    if key == "json_object":
        value = {"type": "object"}
    if key in ("json", "json_object"):
        return llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    if key == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if key == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, value)))
    return llg.LLMatcher.grammar_from_lark(value)


def checked_grammar_text(spec: dict) -> str:
    """The grammar text of `spec`, checked; raises InvalidValue naming the problem."""
    import llguidance as llg
    try:
        text = grammar_text(spec)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InvalidValue(f"{_PARAM} is invalid: {e}", _PARAM) from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidValue(f"{_PARAM} is too large: its grammar has {len(text)} characters, "
                           f"at most {MAX_GRAMMAR_CHARS} are allowed", _PARAM)
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        (key, _), = spec.items()
        what = "JSON schema" if key in ("json", "json_object") else "grammar"
        raise InvalidValue(f"{_PARAM} holds an invalid {what}: {error.strip()}", _PARAM)
    return text


class GrammarChecks:
    """One per ingress replica: specs checked in worker lanes, never on the loop."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self._lanes = CompileLanes("grammar-check")
        self._timeout_s = timeout_s

    async def checked(self, spec: dict | None, size: int) -> dict | None:
        """`{"llguidance": text}` for a spec of about `size` characters (the request
        body's: the text is not known before the work); None for None. Raises
        InvalidValue for a bad or too costly spec, LanesBusy when every worker is."""
        if spec is None:
            return None
        # NOTE: a key of its own: two requests' checks are never joined (their
        # specs are not compared before the work that would compare them)
        try:
            text = await self._lanes.run_async(uuid.uuid4().hex, size,
                                               lambda: checked_grammar_text(spec), self._timeout_s)
        except TooSlow:
            raise InvalidValue(f"{_PARAM} could not be checked within {self._timeout_s:g} s; "
                               "simplify the schema or grammar", _PARAM) from None
        return {CHECKED_KIND: text}


__all__ = ["CHECKED_KIND", "GrammarChecks", "LanesBusy", "checked_grammar_text", "grammar_text"]
