"""The stepstream tokenizer's special ids and the config.json of the random-weight
checkpoints stepstream writes (the presets' and the tests' small models).

Torch-free: replicas/checkpoints/presets.py checks a cached preset against it, and
replicas/checkpoints/random_checkpoint.py (torch) writes checkpoints from it.
"""
from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Ids fixed by replicas/assets/train_tokenizer.py (special tokens come first).
BOS_TOKEN_ID = 0  # <|begin_of_text|>
END_OF_TEXT_TOKEN_ID = 1  # <|end_of_text|>
IM_START_TOKEN_ID = 2  # <|im_start|>
IM_END_TOKEN_ID = 3  # <|im_end|>, the tokenizer's eos_token
PAD_TOKEN_ID = 4  # <|pad|>
EOS_TOKEN_IDS = [IM_END_TOKEN_ID, END_OF_TEXT_TOKEN_ID]  # generation stops at either
TOKENIZER_VOCAB_SIZE = 8192

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def complete_config(config: dict, dtype: str) -> dict:
    """The config.json of a checkpoint stepstream writes: `config` with every field
    whose default the HF config classes disagree on written out."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {sorted(ARCHITECTURES)}, got {model_type!r}")
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
        "architectures": [ARCHITECTURES[model_type]],
        "torch_dtype": dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": PAD_TOKEN_ID,
    }
    explicit = {k: v for k, v in config.items() if not (k in defaults and v is None)}
    return {**defaults, **explicit}
