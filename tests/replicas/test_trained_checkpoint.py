"""The converted SmolLM2 GGUF against transformers loading the same file: every
tensor, the tokenizer, the chat template and the streamed text."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltas.detokenizer import IncrementalDetokenizer
from deltas.tokenization import Tokenizer
from replicas.gguf import read_gguf
from replicas.gguf.llama_layout import hf_name, unpermute_rows
from tests import trained_model

pytestmark = pytest.mark.slow  # transformers' own load of the trained model: not in `make test-fast`

TEXTS = [
    "Hello, world! How are you today?",
    "In 2024, 12345 people paid $3.50 each (a 7.5% rise).",
    "def f(x):\n\treturn x ** 2  # squares\n\n\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🎉👍🏽",
    "   leading spaces, trailing   \n  and\r\nwindows lines",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "I'm sure they'll say we've done it, didn't we? You're RIGHT.",
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Hi there!"},
     {"role": "assistant", "content": "Arr, ahoy matey!"},
     {"role": "user", "content": "Where is the treasure? Ça va?"}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?"}],
    *trained_model.CHATS,
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_dir(trained_model.model_dir())


@pytest.fixture(scope="module")
def converted() -> dict[str, torch.Tensor]:
    return load_file(f"{trained_model.model_dir()}/model.safetensors")


def test_every_tensor_equals_transformers_dequantization(converted):
    theirs = trained_model.hf_model().state_dict()
    expected = {name for name in theirs if name != "lm_head.weight"}  # tied to the embedding
    assert set(converted) == expected
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name


def test_q_and_k_rows_are_unpermuted_as_transformers_does(converted):
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    checkpoint = read_gguf(trained_model.gguf_file())
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    processor = LlamaTensorProcessor(config=config)
    for gguf_name in ("blk.0.attn_q.weight", "blk.17.attn_k.weight", "blk.29.attn_q.weight"):
        tensor = checkpoint.tensors[gguf_name]
        raw = gguf.dequantize(tensor.data, tensor.qtype)
        reference = processor.process(raw, gguf_name).weights
        ours = converted[hf_name(gguf_name)].numpy()
        assert np.array_equal(ours, reference), gguf_name
        assert not np.array_equal(ours, raw), f"{gguf_name}: the permutation must matter"
    heads = 9
    assert np.array_equal(unpermute_rows(raw, heads), reference)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_transformers(ours, text):
    theirs = trained_model.hf_tokenizer()
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_special_ids_and_digits(ours):
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2]
    assert ours.vocab_size == 49152
    assert ours.encode("<|im_start|>") == [1]
    # the file's pre-tokenizer ("smollm") splits every digit on its own
    assert ours.encode("2024") == [ours.token_to_id(d) for d in "2024"]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, conversation, add_generation_prompt):
    theirs = trained_model.hf_tokenizer()
    expected = theirs.apply_chat_template(conversation, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    rendered = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert (ours.encode(rendered, add_special_tokens=False)
            == theirs.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_one_shot_decode(ours, text, skip_special_tokens):
    ids = ours.encode(text, add_special_tokens=False)
    rng = random.Random(len(text))
    detokenizer = IncrementalDetokenizer(ours, skip_special_tokens=skip_special_tokens)
    pieces, start = [], 0
    while start < len(ids):  # pushes of 1 to 3 tokens, as steps release them
        end = start + rng.randint(1, 3)
        pieces.append(detokenizer.push(ids[start:end]))
        start = end
    pieces.append(detokenizer.flush())
    expected = ours.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected
    assert expected == trained_model.hf_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def test_the_ingress_converts_only_the_tokenizer(tmp_path, monkeypatch):
    from replicas.checkpoints import presets

    monkeypatch.setenv("STEPSTREAM_CACHE", str(tmp_path))
    tokenizer_dir = presets.resolve_tokenizer_dir(trained_model.PRESET)
    assert sorted(p.name for p in Path(tokenizer_dir).iterdir()) == [
        "config.json", "generation_config.json", "gguf_source.json", "tokenizer.json",
        "tokenizer_config.json"]
    assert Tokenizer.from_dir(tokenizer_dir).encode(TEXTS[3]) == Tokenizer.from_dir(
        trained_model.model_dir()).encode(TEXTS[3])
    # once the whole conversion is there, the tokenizer comes from it
    # NOTE: the conversion in the user's cache, linked in: converting the weights
    # again would prove nothing more here (test_gguf_files.py converts into a fresh cache)
    converted = Path(trained_model.model_dir())
    model_dir = Path(tokenizer_dir).parent / converted.name
    shutil.copytree(converted, model_dir, copy_function=_link_or_copy)
    assert presets.ensure_model_dir(trained_model.PRESET) == str(model_dir)
    assert presets.resolve_tokenizer_dir(trained_model.PRESET) == str(model_dir)
