"""Hypothesis strategies for hostile request bodies, each one invalid by construction.

A body is a well-formed request with at least one field made invalid (wrong JSON
type, out of range, NaN, huge, out of the vocabulary, n past 128, a bad stop list, an
unknown field), plus optional hostile but legal noise (control characters, odd
unicode); or raw bytes that are not a valid request at all (invalid UTF-8, deep
or truncated JSON, NaN literals, a JSON value that is not an object). So every
answer must be a 4xx; a 2xx or a 5xx is a bug.

Not a test module.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

MODEL = "tiny"
VOCAB_SIZE = 8192
MAX_MODEL_LEN = 512

_CONTROL = st.text(st.characters(min_codepoint=0, max_codepoint=31), min_size=1, max_size=8)
_ODD_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_HUGE_INTS = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**30, -(10**30)])
_NON_INT = st.one_of(st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda f: f != int(f)), st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_NON_NUMBER = st.one_of(st.text(max_size=5), st.booleans(), st.none(),
                        st.lists(st.floats(allow_nan=False), max_size=2))
_NON_STRING = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                        st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                             st.integers(),
                                                                             max_size=2))
_NON_BOOL = st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False))

# NOTE: NaN and Infinity are not JSON: they go in as raw literals (see `_raw_nan`).
_BAD_SHARED = {
    "model": st.one_of(_NON_STRING, st.builds(lambda c: f"tiny{c}", _CONTROL),
                       st.text(max_size=30).filter(lambda s: s != MODEL)),
    "max_tokens": st.one_of(st.integers(max_value=0), _HUGE_INTS,
                            st.integers(min_value=MAX_MODEL_LEN + 1), _NON_INT),
    "temperature": st.one_of(st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
                             st.floats(min_value=100.001, allow_nan=False,
                                       allow_infinity=False), _NON_NUMBER),
    "top_p": st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
                       st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False),
                       _NON_NUMBER),
    "top_k": st.one_of(st.integers(max_value=-2), st.just(0), _NON_INT),
    "min_p": st.one_of(st.floats(min_value=1.001, allow_nan=False, allow_infinity=False),
                       st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False)),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), _NON_INT),
    "n": st.one_of(st.integers(min_value=129), st.integers(max_value=0), _NON_INT),
    "stop": st.one_of(st.just(""), st.lists(st.text(min_size=1, max_size=4), min_size=17,
                                            max_size=30),
                      st.text(min_size=513, max_size=600), st.lists(_NON_STRING, min_size=1,
                                                                    max_size=3),
                      st.just([""]), st.integers(), st.dictionaries(st.text(max_size=2),
                                                                     st.text(max_size=2),
                                                                     min_size=1, max_size=2)),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1,
                                         max_size=3),
                                st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                                st.lists(st.text(max_size=2), min_size=1, max_size=2),
                                st.text(max_size=3)),
    "presence_penalty": st.one_of(st.floats(min_value=2.001, allow_nan=False,
                                            allow_infinity=False), _NON_NUMBER),
    "frequency_penalty": st.floats(max_value=-2.001, allow_nan=False, allow_infinity=False),
    "repetition_penalty": st.one_of(st.floats(max_value=0.0, allow_nan=False,
                                              allow_infinity=False),
                                    st.floats(min_value=2.001, allow_nan=False,
                                              allow_infinity=False)),
    "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=9, max_value=10**6)),
    "stream": _NON_BOOL,
    "stream_options": st.one_of(_NON_BOOL.filter(lambda v: v is not None),
                                st.fixed_dictionaries({"include_usage": _NON_BOOL}),
                                st.fixed_dictionaries({"bogus": st.integers()})),
    "ignore_eos": _NON_BOOL,
    "user": _NON_STRING.filter(lambda v: v is not None),
    "logit_bias": st.one_of(
        st.fixed_dictionaries({"5": st.floats(min_value=100.001, allow_nan=False,
                                              allow_infinity=False)}),
        st.fixed_dictionaries({str(VOCAB_SIZE): st.floats(-100, 100, allow_nan=False)}),
        st.fixed_dictionaries({"-1": st.floats(-100, 100, allow_nan=False)}),
        st.fixed_dictionaries({"x5": st.integers(-100, 100)}),
        st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str), st.just(1), min_size=301,
                        max_size=310),
        _NON_BOOL.filter(lambda v: v is not None)),
}

_BAD_COMPLETION = {
    **_BAD_SHARED,
    "prompt": st.one_of(
        st.just(""), st.just([]), st.integers(), st.floats(allow_nan=False), st.booleans(),
        st.none(), st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
        st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1, max_size=5),  # out of vocab
        st.lists(st.integers(max_value=-1), min_size=1, max_size=5),
        st.lists(_HUGE_INTS, min_size=1, max_size=3),
        st.lists(st.text(min_size=1, max_size=5), min_size=129, max_size=131),  # > 128 choices
        st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3).map(
            lambda batch: batch + [""]),  # a batch with an empty prompt
        st.lists(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=3), min_size=1,
                 max_size=3).map(lambda batch: batch + [[VOCAB_SIZE]]),  # one out of vocab
        st.lists(st.one_of(st.integers(0, 100), st.text(max_size=2)), min_size=2,
                 max_size=4).filter(lambda v: len({type(x) for x in v}) > 1),
        st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=MAX_MODEL_LEN,
                 max_size=MAX_MODEL_LEN + 50),  # no room left for a completion
        st.recursive(st.integers(0, 10), lambda inner: st.lists(inner, min_size=1, max_size=2),
                     max_leaves=6).filter(lambda v: isinstance(v, list) and any(
                         isinstance(x, list) and any(isinstance(y, list) for y in x)
                         for x in v))),
    "logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21), _NON_INT),
    "echo": st.just(True),
    "best_of": st.integers(min_value=2),  # with n left at 1
    "suffix": st.text(min_size=1, max_size=5),
}

_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                  "content": st.text(max_size=20)})
_BAD_CHAT = {
    **_BAD_SHARED,
    "messages": st.one_of(
        st.just([]), _NON_STRING.filter(lambda v: not isinstance(v, list) or v),
        st.lists(st.fixed_dictionaries({"role": st.text(max_size=10).filter(
            lambda r: r not in ("system", "developer", "user", "assistant")),
            "content": st.text(max_size=10)}), min_size=1, max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _NON_STRING.filter(
            lambda v: not (isinstance(v, list) and not v))}),
            min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
            st.fixed_dictionaries({"type": st.text(max_size=6).filter(lambda t: t != "text"),
                                   "text": st.text(max_size=5)}), min_size=1, max_size=2)}),
            min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1,
                 max_size=2),  # no role
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=5),
                                        "extra": st.integers()}), min_size=1, max_size=2)),
    "max_completion_tokens": st.one_of(st.integers(max_value=0),
                                       st.integers(min_value=MAX_MODEL_LEN + 1), _NON_INT),
    "logprobs": _NON_BOOL,
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21), _NON_INT),
    "add_generation_prompt": _NON_BOOL,
}

_KNOWN = set(_BAD_COMPLETION) | set(_BAD_CHAT) | {
    "prompt", "messages", "include_stop_str_in_output", "skip_special_tokens"}
_UNKNOWN_KEY = st.one_of(st.text(min_size=1, max_size=12), _CONTROL).filter(
    lambda k: k not in _KNOWN)
_ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                         lambda inner: st.lists(inner, max_size=3), max_leaves=5)


def _base(chat: bool) -> st.SearchStrategy[dict]:
    """A valid request (short), with hostile but legal text."""
    text = st.one_of(st.just("Once upon a time"), _ODD_TEXT.filter(bool),
                     st.builds(lambda a, c: a + c, st.just("hi"), _CONTROL))
    common = {"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
              "temperature": st.just(0.0)}
    if chat:
        return st.fixed_dictionaries({**common, "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": text}), min_size=1,
            max_size=2)})
    return st.fixed_dictionaries({**common, "prompt": text})


@st.composite
def _mutated(draw, chat: bool) -> bytes:
    body = draw(_base(chat))
    bad = _BAD_CHAT if chat else _BAD_COMPLETION
    fields = draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3, unique=True))
    for name in fields:
        body[name] = draw(bad[name])
    if "max_tokens" not in fields and "max_completion_tokens" not in fields and \
            "min_tokens" in fields and isinstance(body.get("min_tokens"), int):
        body["max_tokens"] = 4  # min_tokens > max_tokens stays invalid
    if draw(st.booleans()):
        body[draw(_UNKNOWN_KEY)] = draw(_ANY_JSON)
    elif draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(["model", "messages" if chat else "prompt"])))
    return json.dumps(body).encode()


@st.composite
def _raw_nan(draw, chat: bool) -> bytes:
    field = draw(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty",
                                  "max_tokens", "seed"]))
    literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]))
    head = json.dumps(draw(_base(chat)))[:-1]
    return f'{head}, "{field}": {literal}}}'.encode()


@st.composite
def _raw_bytes(draw, chat: bool) -> bytes:
    valid = json.dumps(draw(_base(chat))).encode()
    kind = draw(st.sampled_from(["truncated", "invalid_utf8", "deep", "not_object", "random",
                                 "deep_field", "trailing", "huge"]))
    if kind == "truncated":
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "invalid_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80",
                                     b"\x80", b"\\ud800"]))
        key = b'"prompt": "' if not chat else b'"content": "'
        at = valid.find(key)
        at = len(valid) // 2 if at < 0 else at + len(key)
        return valid[:at] + junk + valid[at:]
    if kind == "deep":
        depth = draw(st.integers(200, 20000))
        return b"[" * depth + b"]" * depth
    if kind == "deep_field":
        depth = draw(st.integers(100, 5000))
        name = b"messages" if chat else b"prompt"
        return (b'{"model": "tiny", "' + name + b'": ' + b"[" * depth + b"1" + b"]" * depth
                + b"}")
    if kind == "not_object":
        return json.dumps(draw(_ANY_JSON)).encode()
    if kind == "trailing":
        return valid + draw(st.sampled_from([b"}", b",", b"garbage", b"{}"]))
    if kind == "huge":  # over the server's max_body_bytes (64 KiB in the tests): 413
        return json.dumps({"model": MODEL, "prompt": "a " * 40_000}).encode()
    return draw(st.binary(min_size=1, max_size=200).filter(lambda b: b != valid))


def hostile_bodies(chat: bool) -> st.SearchStrategy[bytes]:
    return st.one_of(_mutated(chat), _mutated(chat), _mutated(chat), _raw_nan(chat),
                     _raw_bytes(chat))
