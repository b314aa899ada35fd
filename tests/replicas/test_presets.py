"""The offline default model: committed tokenizer, preset checkpoints generated from
a fixed seed, and random Llama-family checkpoints that transformers loads exactly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from replicas.checkpoints import presets, random_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_BASE = dict(vocab_size=8192, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                  rope_theta=10000.0, rms_norm_eps=1e-6)
ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\n\t",
    "héllo café naïve Ångström ñ ß Œuvre",
    "日本語のテキスト 中文文本 한국어 텍스트",
    "emoji 🚀🔥👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "math ∑∫√∞ ≠ ≤ ≥ — “quotes” ‘single’ … \u200b zero-width \u00a0 nbsp",
    "combining e\u0301 vs é, RTL שלום مرحبا",
    "<|im_start|> inside text is a special token <|im_end|>",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return presets.ensure_model_dir("tiny", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(presets.resolve_tokenizer_dir("tiny"))


def _load(model_dir: str):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model


def _assert_loaded_exactly(model, model_dir: str) -> None:
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    # Nothing in the model left at its own init: every parameter came from the file
    # (or is lm_head tied to the embeddings).
    missing = {n for n, _ in model.named_parameters()} - saved.keys()
    assert missing <= {"lm_head.weight"}, missing


def test_import_does_not_pull_torch_or_the_checkpoint_writer():
    code = ("import replicas.checkpoints.presets, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'replicas.checkpoints.random_checkpoint' not in sys.modules, 'writer imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_preset_dir_is_complete_and_loads(tiny_dir):
    names = set(os.listdir(tiny_dir))
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in os.listdir(Path(tiny_dir).parent) if n.startswith(".")]  # no temp dirs
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 10000.0
    model = _load(tiny_dir)
    _assert_loaded_exactly(model, tiny_dir)
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert 6_500_000 < model.num_parameters() < 7_500_000
    assert model.num_parameters() == random_checkpoint.num_parameters(presets.PRESETS["tiny"])
    assert model.generation_config.eos_token_id == [presets.IM_END_TOKEN_ID,
                                                     presets.END_OF_TEXT_TOKEN_ID]
    logits = model(torch.tensor([[0, 10, 200, 4000]])).logits
    assert logits.shape == (1, 4, 8192) and torch.isfinite(logits).all()
    # Perturbed norms: a model whose norms are all ones would hide norm bugs.
    assert not torch.equal(model.model.norm.weight, torch.ones(256))


def test_small_preset_size():
    assert 80_000_000 < random_checkpoint.num_parameters(presets.PRESETS["small"]) < 95_000_000


def test_preset_generation_is_deterministic(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSTREAM_CACHE", str(tmp_path))
    other_dir = presets.ensure_model_dir("tiny")
    assert other_dir == str(tmp_path / "models" / f"tiny-{presets.PRESET_VERSION}")
    for name in ("model.safetensors", "config.json"):
        assert Path(other_dir, name).read_bytes() == Path(tiny_dir, name).read_bytes(), name


def test_second_call_reuses_the_dir(tiny_dir):
    mtime = os.stat(Path(tiny_dir, "model.safetensors")).st_mtime_ns
    assert presets.ensure_model_dir("tiny", cache_dir=Path(tiny_dir).parents[1]) == tiny_dir
    assert os.stat(Path(tiny_dir, "model.safetensors")).st_mtime_ns == mtime


def test_losing_the_rename_race_keeps_the_winner(tiny_dir):
    # A process that saw no dir, then lost the race: it must use the winner's dir.
    final_dir = Path(tiny_dir)
    mtime = os.stat(final_dir / "model.safetensors").st_mtime_ns
    presets._generate_preset("tiny", final_dir)
    assert os.stat(final_dir / "model.safetensors").st_mtime_ns == mtime
    assert not [n for n in os.listdir(final_dir.parent) if n.startswith(".")]


def test_concurrent_generation(tmp_path):
    results, errors = [], []

    def generate():
        try:
            results.append(presets.ensure_model_dir("tiny", cache_dir=tmp_path))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=generate) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert os.listdir(tmp_path / "models") == [f"tiny-{presets.PRESET_VERSION}"]
    _load(results[0])


def test_directories_pass_through(tiny_dir, tmp_path):
    assert presets.ensure_model_dir(tiny_dir) == tiny_dir
    assert presets.resolve_tokenizer_dir(tiny_dir) == tiny_dir
    assert presets.resolve_tokenizer_dir("small") == str(presets.ASSETS_DIR)
    assert presets.is_preset("tiny") and not presets.is_preset(tiny_dir)
    with pytest.raises(FileNotFoundError, match="config.json"):
        presets.ensure_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        presets.ensure_model_dir(str(tmp_path / "nope"))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < 8192 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 8192
    assert tokenizer.bos_token_id == presets.BOS_TOKEN_ID
    assert tokenizer.eos_token_id == presets.IM_END_TOKEN_ID
    assert tokenizer.pad_token_id == presets.PAD_TOKEN_ID
    expected = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == expected
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [presets.IM_END_TOKEN_ID]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode(
        "hi", add_special_tokens=False)  # no BOS added implicitly
    every_byte = bytes(range(256)).decode("latin-1")
    assert tokenizer.decode(tokenizer.encode(every_byte, add_special_tokens=False)) == every_byte


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi 🚀"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 🚀<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == presets.IM_START_TOKEN_ID and ids.count(presets.IM_END_TOKEN_ID) == 2
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("model_type,extra,bias_names", [
    ("llama", {}, []),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
     ["self_attn.o_proj.bias", "mlp.down_proj.bias"]),
    ("mistral", {"head_dim": None, "sliding_window": None}, []),
    ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}, ["self_attn.q_proj.bias"]),
    ("qwen3", {"head_dim": 32}, []),
    ("qwen3", {"attention_bias": True}, ["self_attn.k_proj.bias", "self_attn.o_proj.bias"]),
])
def test_random_checkpoint_loads_in_transformers(tmp_path, model_type, extra, bias_names):
    config = {**SMALL_BASE, "model_type": model_type, **extra}
    model_dir = random_checkpoint.write_random_checkpoint(tmp_path / "ckpt", config, seed=7)
    model = _load(model_dir)
    _assert_loaded_exactly(model, model_dir)
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    assert ("lm_head.weight" in saved) == (not config.get("tie_word_embeddings", False))
    assert ("model.layers.0.self_attn.q_norm.weight" in saved) == (model_type == "qwen3")
    for bias in bias_names:
        assert saved[f"model.layers.1.{bias}"].abs().sum() > 0, bias
    if not bias_names:
        assert not [n for n in saved if n.endswith(".bias")]
    assert model.config.rope_parameters["rope_theta"] == config["rope_theta"]
    logits = model(torch.tensor([[0, 5, 300, 8000]])).logits
    assert torch.isfinite(logits).all()
    assert AutoTokenizer.from_pretrained(model_dir).decode([2, 3]) == "<|im_start|><|im_end|>"


def test_random_checkpoint_init_options(tmp_path):
    config = {**SMALL_BASE, "model_type": "qwen2"}
    flat = load_file(random_checkpoint.write_random_checkpoint(tmp_path / "a", config, 3, perturb=False)
                     + "/model.safetensors")
    assert torch.equal(flat["model.norm.weight"], torch.ones(64))
    assert torch.equal(flat["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64))
    assert 0.015 < flat["model.embed_tokens.weight"].std() < 0.025
    bf16_dir = random_checkpoint.write_random_checkpoint(tmp_path / "b", config, 3, dtype="bfloat16")
    bf16 = load_file(bf16_dir + "/model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert json.loads(Path(bf16_dir, "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="model_type"):
        random_checkpoint.write_random_checkpoint(tmp_path / "c", {**config, "model_type": "gpt2"}, 0)
