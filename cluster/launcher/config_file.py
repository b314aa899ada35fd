"""The launcher's reading of what a user typed: its flags' value types and a Serve
config file (`--config`). A mistake costs one line and exit status 2 before Ray
starts, never a traceback or a minute of start-up. No torch, no Ray.

The launcher serves one application from a config: its `args`, on `http_options`'
host and port. What else the file sets and the launcher would not do the same way
(more applications, `deployments`, other HTTP options, ...) is named in a warning,
so nobody takes a setting for applied that `serve run` would apply and the
launcher does not.
"""
from __future__ import annotations

import argparse
from typing import NamedTuple

# What the launcher does anyway, so a config that says the same loses nothing.
_SAME_AS_LAUNCHER = {"name": "stepstream", "route_prefix": "/",
                     "import_path": "cluster.app:build_app"}
# One node: a proxy on every node or on the head is the same one.
_ONE_NODE_PROXY_LOCATIONS = ("EveryNode", "HeadOnly")
# The runtime_env the launcher sets itself (cluster/launcher/front_door.py).
_LAUNCHER_ENV_VARS = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"}


def port_number(text: str) -> int:
    """argparse type: a TCP port a server can bind (1-65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


class ConfigError(ValueError):
    """A --config file the launcher cannot read: said in one line, before Ray starts."""


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, not {type(value).__name__}")
    return dict(value)


class ServeConfig(NamedTuple):
    """What the launcher takes from a Serve config file, and what it leaves."""

    args: dict  # applications[0].args
    http_options: dict  # host and port
    unused: list[str]  # the settings it does not apply, by their place in the file


def _launcher_env_only(runtime_env) -> bool:
    """A runtime_env that sets only environment variables the launcher sets itself."""
    if not isinstance(runtime_env, dict) or set(runtime_env) - {"env_vars"}:
        return False
    env_vars = runtime_env.get("env_vars") or {}
    return isinstance(env_vars, dict) and set(env_vars) <= _LAUNCHER_ENV_VARS


def unused_settings(config: dict) -> list[str]:
    """The settings of a Serve config that the launcher does not apply, e.g.
    `http_options.request_timeout_s`, `applications[0].deployments`, `applications[1:]`."""
    unused = []
    for key, value in config.items():
        if key == "proxy_location" and value in _ONE_NODE_PROXY_LOCATIONS:
            continue
        if key not in ("applications", "http_options"):
            unused.append(key)
    http = config.get("http_options") or {}
    unused += [f"http_options.{key}" for key in http if key not in ("host", "port")]
    apps = config.get("applications") or [{}]
    for key, value in apps[0].items():
        same = (key == "args" or _SAME_AS_LAUNCHER.get(key, object()) == value
                or key == "runtime_env" and _launcher_env_only(value))
        if not same:
            unused.append(f"applications[0].{key}")
    if len(apps) > 1:
        unused.append(f"applications[1:] ({len(apps) - 1} more)")
    return unused


def read_config(path: str) -> ServeConfig:
    """What the launcher serves of a Serve config file."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}: "
                          f"{getattr(e, 'problem', None) or e}") from None
    config = _mapping(config, f"{path}: the file")
    apps = config.get("applications") or [{}]
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise ConfigError(f"{path}: applications must be a list of mappings")
    http = _mapping(config.get("http_options"), f"{path}: http_options")
    if "port" in http:
        try:
            http["port"] = port_number(str(http["port"]))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{path}: http_options.port: {e}") from None
    return ServeConfig(_mapping(apps[0].get("args"), f"{path}: applications[0].args"), http,
                       unused_settings(config))
