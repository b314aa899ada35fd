"""The offline default models: preset configs and their generated checkpoints.

A preset ("tiny", "small") is a Llama config plus weights drawn from a fixed seed,
materialised on first use as a normal Hugging Face directory (config.json,
model.safetensors, tokenizer files, generation_config.json) under
`$STEPSTREAM_CACHE/models/<name>-v1` (default cache: `~/.cache/stepstream`).
The tokenizer is the committed `replicas/assets/tokenizer.json`.

NOTE: this module must import without torch (the ingress imports it on CPU nodes
to find a preset's tokenizer). The weights are written by
replicas/random_checkpoint.py, imported only when a preset is materialised.
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
    from replicas.random_checkpoint import write_random_checkpoint  # NOTE: torch, here only

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
    if cached_config != complete_config(PRESETS[name], PRESETS[name]["torch_dtype"]):
        raise RuntimeError(f"{model_dir} was generated from a different '{name}' config; "
                           f"bump PRESET_VERSION in replicas/presets.py or delete the directory")


def complete_config(config: dict, dtype: str) -> dict:
    """The config.json of a checkpoint stepstream writes: `config` with every field
    whose default the HF config classes disagree on written out."""
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
