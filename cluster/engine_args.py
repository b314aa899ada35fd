"""The engine's settings as a Serve config and the launcher see them, derived
from `replicas.config.EngineConfig` so that no field is mirrored by hand.

`EngineArgs` has one pydantic field per `EngineConfig` field, with the same name,
type and default; `EngineConfig.__post_init__` stays the only range check (the
app's validator builds one). The one exception is `device`: here it defaults to
None, which `resolve_device` turns into "cuda" when the replica gets a GPU and
"cpu" otherwise. `add_engine_flags` makes one `--flag` per field for the local
launcher. Torch-free and Ray-free (the launcher imports it before Ray starts).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from pydantic import BaseModel, ConfigDict, Field, create_model

from replicas.config import (ATTENTION_BACKENDS, CPU_KV_CACHE_GIB, CPU_KV_CACHE_MEMORY_SHARE,
                             CPU_KV_CACHE_MIN_GIB, EngineConfig)

ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))
_HINTS = typing.get_type_hints(EngineConfig)
# Defaults that differ from EngineConfig's, on purpose.
DEVICE_DEFAULT = None  # None: "cuda" when engine_num_gpus > 0, else "cpu"
# What each field means, for the launcher's --help and the config table of
# cluster/README.md (cluster/args_table.py). Ranges: EngineConfig checks them.
_HELP = {
    "model": "a preset (smollm2-135m: trained; tiny, small: random weights), a .gguf file or a local Hugging Face checkpoint directory",
    "dtype": "auto: on CPU bfloat16 for a bfloat16 or quantized checkpoint where the CPU "
             "runs it natively, else float32; the checkpoint's dtype on CUDA "
             "(replicas/checkpoints/dtype_choice.py)",
    "device": "null: cuda when the engine replica has a GPU (engine_num_gpus > 0), else cpu",
    "max_model_len": "context length; null: the model's own",
    "block_size": "tokens per KV cache block (a power of two)",
    "num_kv_blocks": "KV cache blocks; null: sized by kv_cache_gib or gpu_memory_utilization",
    "kv_cache_gib": f"KV cache in GiB: on CPU its size (null: {CPU_KV_CACHE_GIB:g} GiB, at most "
                    f"{CPU_KV_CACHE_MEMORY_SHARE:.0%} of the memory available at start-up, at "
                    f"least {CPU_KV_CACHE_MIN_GIB:g} GiB); on CUDA a cap on what "
                    "gpu_memory_utilization leaves (null: no cap); never more than max_num_seqs "
                    "full-length sequences use",
    "gpu_memory_utilization": "CUDA: the share of device memory for the weights, the largest "
                              "step, the sampler's headroom and the KV cache (what it leaves is "
                              "for CUDA graphs); the profile assumes flash-attn or our Triton "
                              "kernels: with attention_backend torch, lower it",
    "max_num_seqs": "sequences per batch, per engine replica",
    "max_num_batched_tokens": "tokens per engine step; longer prompts are prefilled in chunks",
    "num_scheduler_steps": "decode steps per scheduling decision (multi-step decoding)",
    "async_output": "process step k's outputs while step k+1 runs",
    "release_per_step": "each decode step's tokens stream out as soon as the step is done "
                        "(false: at the end of a multi-step window)",
    "attention_backend": f"one of {', '.join(ATTENTION_BACKENDS)}",
    "enforce_eager": "true: no CUDA graphs for decode",
    "seed": "the engine's random seed (a request may bring its own)",
    "max_waiting_requests": "engine queue bound: past it new requests get 429 + Retry-After; "
                            "null: unbounded",
    "max_waiting_prompt_tokens": "engine queue bound on prompt tokens waiting (429 past it); "
                                 "null: unbounded",
    "tensor_parallel_size": "ranks each engine replica splits the model over (tensor "
                            "parallelism: one GPU each, or engine_num_cpus each on CPU; a "
                            "placement group of one bundle per rank); rank 0 schedules and "
                            "samples; float weights (a GGUF file is dequantized)",
    "num_threads": "torch threads per engine replica; null: engine_num_cpus (at least 1) on "
                   "CPU, torch's own on CUDA",
    "quantization": "auto: a GGUF file's quantized matrices run as stored on CPU, other "
                    "checkpoints as stored; none: dequantized at load (the exact path); gguf: "
                    "a GGUF file's own types, also on a GPU (Triton); int8/int4: float "
                    "weights quantized at load (replicas/quant/choice.py)",
    "use_idle_cores": "CPU: while every other engine replica on the machine is idle and no other "
                      "process wants a core, this one's steps run on all the cores (a lone "
                      "stream gets the machine's memory bandwidth); with num_threads below the "
                      "cores",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes computed before (system "
                             "prompts, chat turns)",
}


def _default(f: dataclasses.Field):
    if f.name == "device":
        return DEVICE_DEFAULT
    return f.default


def _annotation(f: dataclasses.Field):
    if f.name == "device":
        return str | None
    return _HINTS[f.name]


EngineArgs: type[BaseModel] = create_model(
    "EngineArgs", __config__=ConfigDict(extra="forbid"),
    **{f.name: (_annotation(f), Field(_default(f), description=_HELP.get(f.name)))
       for f in dataclasses.fields(EngineConfig)})
EngineArgs.__doc__ = "One field per EngineConfig field (see the module docstring)."


def resolve_device(device: str | None, engine_num_gpus: float) -> str:
    return device or ("cuda" if engine_num_gpus > 0 else "cpu")


def engine_config_dict(args: BaseModel, engine_num_gpus: float) -> dict:
    """EngineConfig's keyword arguments from a model that has every engine field."""
    values = {name: getattr(args, name) for name in ENGINE_FIELDS}
    values["device"] = resolve_device(values["device"], engine_num_gpus)
    return values


def _scalar(hint) -> type:
    """`int | None` -> int; a plain type stays itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per engine field, default None (not given: the config's value or
    AppArgs' default stays). Booleans get --x and --no-x."""
    for name in ENGINE_FIELDS:
        kind = _scalar(_HINTS[name])
        help_ = _HELP.get(name)
        if help_ is not None:
            help_ = help_.replace("%", "%%")  # NOTE: argparse formats help with %
        if kind is bool:
            parser.add_argument(flag_name(name), dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_)
        else:
            parser.add_argument(flag_name(name), dest=name, type=kind, default=None, help=help_)


def engine_flag_values(ns: argparse.Namespace) -> dict:
    """The engine fields given on the command line."""
    return {name: getattr(ns, name) for name in ENGINE_FIELDS if getattr(ns, name) is not None}
