"""The launcher's reading of what a user typed: its flags' value types and a Serve
config file (`--config`). A mistake costs one line and exit status 2 before Ray
starts, never a traceback or a minute of start-up. No torch, no Ray.
"""
from __future__ import annotations

import argparse


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


def read_config(path: str) -> tuple[dict, dict]:
    """(applications[0].args, http_options) of a Serve config file."""
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
    return _mapping(apps[0].get("args"), f"{path}: applications[0].args"), http
