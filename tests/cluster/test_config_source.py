"""One config source: every EngineConfig field is a Serve config key (AppArgs) with
the same default, reaches EngineConfig through engine_config_dict, and has a flag
of the local launcher. The tests walk the dataclass, so a new field cannot be
forgotten. No Ray is started."""
import dataclasses

import pytest
from pydantic import ValidationError

from cluster.engine_args import ENGINE_FIELDS, flag_name
from replicas.config import EngineConfig

# Non-default values the generic rule below cannot make up (strings).
_STRINGS = {"model": "small", "dtype": "bfloat16", "device": "cuda",
            "attention_backend": "torch", "quantization": "int8"}


def _other_value(f: dataclasses.Field):
    """A valid value of field `f` that is not its default."""
    if f.name in _STRINGS:
        return _STRINGS[f.name]
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, float):
        return f.default / 2  # floats here are > 0, some at most 1 (fractions)
    if f.default is None or isinstance(f.default, int):
        return (f.default or 1) * 2  # ints here are powers of two or unbounded above
    raise AssertionError(f"add a non-default value for EngineConfig.{f.name} to _STRINGS")


FIELDS = dataclasses.fields(EngineConfig)


def test_engine_fields_are_app_args_fields_with_the_same_defaults():
    from cluster.app import AppArgs

    assert ENGINE_FIELDS == tuple(f.name for f in FIELDS)
    for f in FIELDS:
        assert f.name in AppArgs.model_fields, f.name
        default = AppArgs.model_fields[f.name].default
        if f.name == "device":  # None: derived from engine_num_gpus
            assert default is None
        else:
            assert default == f.default, f.name
    # The defaults of a Serve config are EngineConfig's defaults, device included;
    # the torch threads follow engine_num_cpus (1 by default) on CPU.
    assert AppArgs.model_validate({}).engine_config() == EngineConfig(num_threads=1)


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_engine_field_reaches_the_engine_from_a_serve_config(f):
    from cluster.app import AppArgs

    value = _other_value(f)
    cfg = AppArgs.model_validate({f.name: value}).engine_config()
    assert getattr(cfg, f.name) == value
    assert AppArgs.model_validate({f.name: value}).engine_config_dict()[f.name] == value


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_engine_field_has_a_launcher_flag(f):
    from cluster.serve_local import chosen_args, parse_args

    value = _other_value(f)
    argv = ([flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:]]
            if isinstance(value, bool) else [flag_name(f.name), str(value)])
    # NOTE: what the flags chose, before the launcher's CPU layout (test_cpu_layout.py)
    args, _ = chosen_args(parse_args(argv))
    assert args == {f.name: value}


def test_device_follows_the_gpus_unless_set():
    from cluster.app import AppArgs

    assert AppArgs.model_validate({}).engine_config().device == "cpu"
    assert AppArgs.model_validate({"engine_num_gpus": 1}).engine_config().device == "cuda"
    assert AppArgs.model_validate({"engine_num_gpus": 1, "device": "cpu"}).engine_config() \
        .device == "cpu"


@pytest.mark.parametrize("args, threads", [
    ({}, 1),
    ({"engine_num_cpus": 2}, 2),
    ({"engine_num_cpus": 2.5}, 2),  # never more threads than cores allotted
    ({"engine_num_cpus": 0.5}, 1),
    ({"engine_num_cpus": 4, "num_threads": 3}, 3),  # num_threads overrides
    ({"engine_num_cpus": 4, "engine_num_gpus": 1}, None),  # GPU: torch's own default
])
def test_torch_threads_follow_the_replicas_cpu_allotment(args, threads):
    from cluster.app import AppArgs

    assert AppArgs.model_validate(args).engine_config().num_threads == threads


def test_engine_ranges_are_enforced_by_the_serve_config():
    from cluster.app import AppArgs

    assert AppArgs.model_validate({"enforce_eager": True}).engine_config().enforce_eager
    for bad in ({"enforce_eager": "sometimes"}, {"dtype": "int8"}, {"block_size": 3},
                {"num_scheduler_steps": 65}, {"attention_backend": "other"}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_old_launcher_flags_still_work():
    from cluster.serve_local import chosen_args, parse_args

    args, _ = chosen_args(parse_args(["--release-per-window", "--no-async-output"]))
    assert args == {"release_per_step": False, "async_output": False}


def test_admissions_keep_room_below_engine_max_ongoing_requests():
    """16 slots for unary calls and one per ingress replica's channel are kept from
    admissions: a smaller bound leaves no room to admit, and is refused."""
    from pydantic import ValidationError

    from cluster.app import AppArgs

    with pytest.raises(ValidationError, match="engine_max_ongoing_requests must be > 17"):
        AppArgs(engine_max_ongoing_requests=17)
    assert AppArgs(engine_max_ongoing_requests=18).engine_max_admitted == 1
    assert AppArgs(num_ingress_replicas=4).engine_max_admitted == 2 * 256
