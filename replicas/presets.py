"""The offline default models: preset configs, their generated checkpoints, and a
writer of random Llama-family checkpoints for tests.

A preset ("tiny", "small") is a Llama config plus weights drawn from a fixed seed,
materialised on first use as a normal Hugging Face directory (config.json,
model.safetensors, tokenizer files, generation_config.json) under
`$STEPSTREAM_CACHE/models/<name>-v1` (default cache: `~/.cache/stepstream`).
The tokenizer is the committed `replicas/assets/tokenizer.json`.

NOTE: this module must import without torch (the ingress imports it on CPU nodes);
torch and safetensors are imported inside the functions that write weights.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().with_name("assets")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# NOTE: bump when a preset's config, seed, init or the tokenizer changes, so that
# cached directories of the old version are never mistaken for the new one.
PRESET_VERSION = "v1"

# Ids fixed by replicas/assets/train_tokenizer.py (special tokens come first).
BOS_TOKEN_ID = 0  # <|begin_of_text|>
END_OF_TEXT_TOKEN_ID = 1  # <|end_of_text|>
IM_START_TOKEN_ID = 2  # <|im_start|>
IM_END_TOKEN_ID = 3  # <|im_end|>, the tokenizer's eos_token
PAD_TOKEN_ID = 4  # <|pad|>
EOS_TOKEN_IDS = [IM_END_TOKEN_ID, END_OF_TEXT_TOKEN_ID]  # generation stops at either
TOKENIZER_VOCAB_SIZE = 8192

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "float32",
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_IDS,
    "pad_token_id": PAD_TOKEN_ID,
}

PRESETS: dict[str, dict] = {
    # ~7.1M parameters; most of them in the embeddings and lm_head.
    "tiny": {**_LLAMA_COMMON, "hidden_size": 256, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688},
    # ~88M parameters.
    "small": {**_LLAMA_COMMON, "hidden_size": 768, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048},
}
PRESET_SEEDS: dict[str, int] = {"tiny": 1234, "small": 5678}

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def default_cache_dir() -> Path:
    return Path(os.environ.get("STEPSTREAM_CACHE") or Path.home() / ".cache" / "stepstream")


def resolve_tokenizer_dir(name_or_path: str) -> str:
    """The directory to load the tokenizer from: the assets dir for a preset, else the
    model directory itself."""
    if is_preset(name_or_path):
        return str(ASSETS_DIR)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{name_or_path!r} is neither a preset {sorted(PRESETS)} "
                                f"nor a model directory")
    return str(path)


def ensure_model_dir(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A complete HF model directory for a preset name (generated on first use) or a
    local checkpoint directory (checked, returned as is)."""
    if not is_preset(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{name_or_path!r} is neither a preset {sorted(PRESETS)} "
                                    f"nor a model directory")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        return str(path)
    models_dir = Path(cache_dir or default_cache_dir()).expanduser() / "models"
    final_dir = models_dir / f"{name_or_path}-{PRESET_VERSION}"
    if not final_dir.is_dir():
        _generate_preset(name_or_path, models_dir, final_dir)
    _check_preset_dir(name_or_path, final_dir)
    return str(final_dir)


def _generate_preset(name: str, models_dir: Path, final_dir: Path) -> None:
    # NOTE: several processes may get here at once. Each writes a private temp dir in
    # the same parent and renames it into place; rename is atomic, and it fails
    # when another process's (complete, non-empty) dir already took the name.
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=models_dir))
    try:
        write_random_checkpoint(tmp_dir, PRESETS[name], seed=PRESET_SEEDS[name])
        # mkdtemp makes the dir private; a shared cache must be readable by others.
        os.chmod(tmp_dir, 0o755)
        for file in tmp_dir.iterdir():
            os.chmod(file, 0o644)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _check_preset_dir(name: str, model_dir: Path) -> None:
    with open(model_dir / "config.json") as f:
        cached_config = json.load(f)
    if cached_config != _complete_config(PRESETS[name], PRESETS[name]["torch_dtype"]):
        raise RuntimeError(f"{model_dir} was generated from a different '{name}' config; "
                           f"bump PRESET_VERSION in replicas/presets.py or delete the directory")


def write_random_checkpoint(path: str | os.PathLike, config: dict, seed: int,
                            perturb: bool = True, dtype: str = "float32") -> str:
    """Write a complete HF directory (config, random weights with HF names, the
    stepstream tokenizer, generation config) for a llama/mistral/qwen2/qwen3 config.

    Missing `architectures`, `torch_dtype`, `head_dim`, `num_key_value_heads`,
    `tie_word_embeddings` and bos/eos/pad ids are written out explicitly (from the
    model type, `dtype`, hidden/heads and the stepstream tokenizer); the rest of the
    config is written as given. vocab_size must cover the tokenizer (>= 8192).
    Same seed: same bytes.
    """
    import torch
    from safetensors.torch import save_file

    config = _complete_config(config, dtype)
    generator = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    tensors = {}
    for name, shape in shapes.items():  # NOTE: fixed order, so the same seed gives the same weights
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
            if perturb:  # unit norms hide bugs (a norm applied twice, or not at all)
                tensor += 0.1 * torch.randn(shape, generator=generator)
        else:  # matrices and biases: zero biases would hide bugs too, so they are drawn
            tensor = 0.02 * torch.randn(shape, generator=generator)
            if name.endswith(".bias") and not perturb:
                tensor.zero_()
        tensors[name] = tensor.to(getattr(torch, dtype)).contiguous()

    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    for file_name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS_DIR / file_name, out_dir / file_name)
    return str(out_dir)


def _complete_config(config: dict, dtype: str) -> dict:
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {model_type!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if config["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (the stepstream "
                         f"tokenizer's), got {config['vocab_size']}")
    num_heads = config["num_attention_heads"]
    # NOTE: written out explicitly because the HF config classes disagree on their
    # defaults (Qwen3Config: head_dim 128; Mistral/Qwen: 8 or 32 KV heads), and the
    # weights here are shaped by "absent: hidden/heads, all heads".
    defaults = {
        "num_key_value_heads": num_heads,
        "head_dim": config["hidden_size"] // num_heads,
        "tie_word_embeddings": False,
        "architectures": [_ARCHITECTURES[model_type]],
        "torch_dtype": dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": PAD_TOKEN_ID,
    }
    explicit = {k: v for k, v in config.items() if not (k in defaults and v is None)}
    return {**defaults, **explicit}


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint, in a fixed order."""
    model_type = config["model_type"]
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    inter = config["intermediate_size"]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    # Which projections carry biases differs by family (see each HF modeling file).
    attention_bias = model_type in ("llama", "qwen3") and config.get("attention_bias", False)
    qkv_bias = model_type == "qwen2" or attention_bias
    mlp_bias = model_type == "llama" and config.get("mlp_bias", False)

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (size, hidden)
            if qkv_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (size,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
        if attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if model_type == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for proj, out_size, in_size in (("gate", inter, hidden), ("up", inter, hidden),
                                        ("down", hidden, inter)):
            shapes[p + f"mlp.{proj}_proj.weight"] = (out_size, in_size)
            if mlp_bias:
                shapes[p + f"mlp.{proj}_proj.bias"] = (out_size,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def num_parameters(config: dict) -> int:
    total = 0
    for shape in checkpoint_shapes(config).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
