"""TextStream: token deltas in, text deltas out, cut at stop strings."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltas.text_stream import TextStream
from deltas.tokenization.tokenizer import Tokenizer
from deltas.types import FinishReason, TextDelta, TokenDelta
from tests.deltas_tokenizers import SAMPLE_TEXTS, byte_level_tokenizer

TOKENIZER = byte_level_tokenizer()


def token_deltas(ids: list[int], cuts: list[int], finish=FinishReason.LENGTH) -> list[TokenDelta]:
    """Engine-like deltas: cumulative num_output_tokens, one logprob per token."""
    points = sorted({0, len(ids), *[c for c in cuts if c <= len(ids)]})
    deltas = []
    for a, b in zip(points, points[1:]):
        deltas.append(TokenDelta("r", ids[a:b], logprobs=[-float(i) for i in range(a, b)],
                                 num_prompt_tokens=7, num_output_tokens=b))
    if not deltas:
        deltas.append(TokenDelta("r", [], num_prompt_tokens=7))
    deltas[-1].finish_reason = finish
    return deltas


def stream(deltas: list[TokenDelta], tokenizer: Tokenizer = TOKENIZER, **kwargs) -> list[TextDelta]:
    text_stream = TextStream(tokenizer, **kwargs)
    outputs = []
    for delta in deltas:
        out = text_stream.push(delta)
        outputs.append(out)
        if out.finish_reason is not None:
            break
    return outputs


def tokens_to_complete(ids: list[int], num_chars: int) -> int:
    """Fewest tokens whose complete characters reach `num_chars` (oracle: full decodes)."""
    for k in range(len(ids) + 1):
        if len(TOKENIZER.decode(ids[:k]).rstrip("\ufffd")) >= num_chars:
            return k
    return len(ids)


def test_without_stops_text_is_the_decode():
    ids = TOKENIZER.encode(SAMPLE_TEXTS[3])
    outputs = stream(token_deltas(ids, list(range(0, len(ids), 3))))
    assert "".join(o.text for o in outputs) == SAMPLE_TEXTS[3]
    assert [i for o in outputs for i in o.token_ids] == ids
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert outputs[-1].num_output_tokens == len(ids) and outputs[-1].num_prompt_tokens == 7


def test_stop_string_spanning_deltas_cuts_text_and_tokens():
    text = "The rain in Spain stays mainly in the plain."
    ids = TOKENIZER.encode(text)
    outputs = stream(token_deltas(ids, list(range(0, len(ids), 2))), stop=["mainly"])
    assert "".join(o.text for o in outputs) == "The rain in Spain stays "
    last = outputs[-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == "mainly"
    num_kept = tokens_to_complete(ids, text.index("mainly") + len("mainly"))
    reported = [i for o in outputs for i in o.token_ids]
    assert reported == ids[:num_kept]
    assert [lp for o in outputs for lp in o.logprobs] == [-float(i) for i in range(num_kept)]
    assert last.num_output_tokens == num_kept


def test_include_stop_str_in_output():
    ids = TOKENIZER.encode("say hello world now")
    outputs = stream(token_deltas(ids, [3]), stop=["world"], include_stop_str_in_output=True)
    assert "".join(o.text for o in outputs) == "say hello world"


def test_stop_string_in_the_finishing_delta_wins_over_length():
    ids = TOKENIZER.encode("abc END")
    outputs = stream(token_deltas(ids, []), stop=["END"])
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason == "END"
    assert "".join(o.text for o in outputs) == "abc "


def test_held_text_is_flushed_at_the_finish():
    ids = TOKENIZER.encode("wait for </ans")
    outputs = stream(token_deltas(ids, list(range(len(ids)))), stop=["</answer>"])
    assert "".join(o.text for o in outputs) == "wait for </ans"
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert outputs[-2].text == ""  # the last token only grew the held "</ans"


def test_eos_is_not_text_and_pending_bytes_flush():
    eos = TOKENIZER.eos_token_ids[0]
    ids = TOKENIZER.encode("ok 😀")
    deltas = token_deltas(ids[:-1] + [eos], [len(ids) - 1], finish=FinishReason.STOP)
    outputs = stream(deltas)
    assert "".join(o.text for o in outputs) == "ok \ufffd"  # the emoji's last byte never came


def test_pushes_after_the_finish_are_empty():
    text_stream = TextStream(TOKENIZER, stop=["b"])
    ids = TOKENIZER.encode("abc")
    out = text_stream.push(TokenDelta("r", ids, num_output_tokens=len(ids)))
    assert out.finish_reason == FinishReason.STOP and text_stream.finished
    late = text_stream.push(TokenDelta("r", TOKENIZER.encode("more"), num_output_tokens=9))
    assert late.text == "" and late.token_ids == [] and late.finish_reason is None


def test_error_delta_keeps_the_message():
    ids = TOKENIZER.encode("partial")
    outputs = stream([TokenDelta("r", ids, num_output_tokens=len(ids)),
                      TokenDelta("r", [], finish_reason=FinishReason.ERROR, error="boom",
                                 num_output_tokens=len(ids))])
    assert outputs[-1].finish_reason == FinishReason.ERROR and outputs[-1].error == "boom"
    assert "".join(o.text for o in outputs) == "partial"


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    text=st.text(alphabet="ab é日😀", max_size=25),
    stops=st.lists(st.text(alphabet="ab é日😀", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 80)),
    include=st.booleans(),
)
def test_any_split_equals_decode_cut_at_the_first_stop(text, stops, cuts, include):
    ids = TOKENIZER.encode(text)
    outputs = stream(token_deltas(ids, cuts), stop=stops, include_stop_str_in_output=include)
    full = TOKENIZER.decode(ids)
    matches = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if not matches:
        assert "".join(o.text for o in outputs) == full
        assert [i for o in outputs for i in o.token_ids] == ids
        return
    end, neg_len, stop = min(matches)
    assert "".join(o.text for o in outputs) == (full[:end] if include else full[:end + neg_len])
    assert outputs[-1].stop_reason == stop and outputs[-1].finish_reason == FinishReason.STOP
    num_kept = tokens_to_complete(ids, end)
    assert [i for o in outputs for i in o.token_ids] == ids[:num_kept]
    assert outputs[-1].num_output_tokens == num_kept


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_option(skip_special_tokens):
    eos = TOKENIZER.token_to_id("</s>")
    ids = TOKENIZER.encode("hi") + [eos]
    outputs = stream(token_deltas(ids, [1]), skip_special_tokens=skip_special_tokens)
    assert "".join(o.text for o in outputs) == ("hi" if skip_special_tokens else "hi</s>")


def _min_tokens_oracle(ids: list[int], stop: str, min_tokens: int) -> tuple[str, int] | None:
    """(text, tokens) where a stream with min_tokens stops: the first stop string that
    ends in the text after the first min_tokens tokens' text, wholly inside it; None:
    no stop."""
    free = TOKENIZER.decode(ids[:min_tokens])
    rest = TOKENIZER.decode(ids)[len(free):]
    at = rest.find(stop)
    if at < 0:
        return None
    num_chars = len(free) + at + len(stop)
    return free + rest[:at], max(min_tokens, tokens_to_complete(ids, num_chars))


@given(min_tokens=st.integers(0, 30), cut=st.integers(1, 5))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens(min_tokens, cut):
    """A stop string does not end a stream inside its first min_tokens tokens, whatever
    the deltas' cuts: it ends at the first match in the text after them."""
    text = "one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\n"
    ids = TOKENIZER.encode(text)
    outputs = stream(token_deltas(ids, list(range(0, len(ids), cut))), stop=["\n"],
                     min_tokens=min_tokens)
    expected = _min_tokens_oracle(ids, "\n", min_tokens)
    got_text = "".join(o.text for o in outputs)
    got_ids = [i for o in outputs for i in o.token_ids]
    if expected is None:
        assert got_text == text and outputs[-1].finish_reason == FinishReason.LENGTH
        return
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason == "\n"
    assert (got_text, len(got_ids)) == expected
    assert outputs[-1].num_output_tokens == len(got_ids)
    assert len(got_ids) > min_tokens or min_tokens == 0
