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

from pydantic import BaseModel, ConfigDict, create_model

from replicas.config import EngineConfig

ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))
_HINTS = typing.get_type_hints(EngineConfig)
# Defaults that differ from EngineConfig's, on purpose.
DEVICE_DEFAULT = None  # None: "cuda" when engine_num_gpus > 0, else "cpu"
# Launcher help where the name alone does not say enough.
_HELP = {
    "model": "preset name (tiny, small) or a local HF directory",
    "num_threads": "torch threads per engine replica (default: --engine-num-cpus on CPU)",
    "device": "default: cuda when the engine replica has a GPU, else cpu",
    "enforce_eager": "--enforce-eager: no CUDA graphs for decode",
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
    **{f.name: (_annotation(f), _default(f)) for f in dataclasses.fields(EngineConfig)})
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
        if kind is bool:
            parser.add_argument(flag_name(name), dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_)
        else:
            parser.add_argument(flag_name(name), dest=name, type=kind, default=None, help=help_)


def engine_flag_values(ns: argparse.Namespace) -> dict:
    """The engine fields given on the command line."""
    return {name: getattr(ns, name) for name in ENGINE_FIELDS if getattr(ns, name) is not None}
