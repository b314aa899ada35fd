"""What the local launcher checks before it starts Ray, so that a mistake a user
can fix costs a line of text, not a minute of start-up and a traceback.

Torch-free and Ray-free: the launcher runs these before `import ray`.
"""
from __future__ import annotations

import errno
import os
import socket

from replicas.gguf import GgufError
from replicas.gguf.convert import is_gguf_path
from replicas.checkpoints.presets import PRESETS, TRAINED_PRESETS, ensure_model_dir, preset_names

DEFAULT_METRICS_PORT = 8080


def bind_problem(host: str, port: int) -> str | None:
    """None when a server could listen on (`host`, `port`) now, else why not.

    NOTE: SO_REUSEADDR, as HAProxy, uvicorn and Ray's exporter set it: a port left
    in TIME_WAIT by a server that just stopped is free for them, so it is here too;
    a port something listens on is not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"{host!r} is not a host name or address this machine resolves ({e.strerror})"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use on {host or 'this machine'}"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            if e.errno == errno.EACCES:
                return f"port {port} needs privileges this user lacks (ports below 1024 do)"
            return f"cannot listen on {host}:{port} ({e.strerror})"
    return None


def free_port() -> int:
    """A port nothing listens on now, on every interface."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def metrics_port(requested: int | None) -> tuple[int | None, str | None]:
    """(the port for Ray's metrics, a warning) or (None, why it cannot be used).

    An explicit --metrics-port must be free; the default falls back to a free port,
    so a second launcher on one machine still starts (and says where its metrics are)."""
    port = requested or DEFAULT_METRICS_PORT
    # NOTE: Ray binds its exporter on every interface unless the node's address is
    # a loopback one: check them all.
    problem = bind_problem("", port)
    if problem is None:
        return port, None
    if requested is not None:
        return None, problem
    fallback = free_port()
    return fallback, (f"metrics on port {fallback}: {problem} (pass --metrics-port to pick one)")


def model_problem(model: str) -> str | None:
    """None when `model` is a preset, a GGUF file stepstream can serve or a directory
    holding a checkpoint's config.json.

    NOTE: a GGUF file (a trained preset's too) is converted here, once, before Ray
    starts: every problem with it is one line now, and the replicas find it converted."""
    if model in PRESETS:
        return None
    if model in TRAINED_PRESETS or is_gguf_path(model):
        try:
            ensure_model_dir(model)
        except GgufError as error:  # names the file
            return str(error)
        except (OSError, ValueError) as error:
            return f"--model {model}: {error}"
        return None
    if not os.path.isdir(model):
        return (f"--model {model}: neither a preset ({', '.join(preset_names())}), a .gguf "
                "file nor a directory on this machine")
    if not os.path.isfile(os.path.join(model, "config.json")):
        return f"--model {model}: the directory has no config.json (a Hugging Face checkpoint has)"
    return None


def gpu_problem(num_gpus_needed: float, num_gpus_seen: float) -> str | None:
    """None when Ray sees the GPUs the engine replicas ask for, else what to do.

    NOTE: without this check Serve waits for the resources forever, silently."""
    if num_gpus_needed <= num_gpus_seen:
        return None
    seen = f"{num_gpus_seen:g} GPU{'s' if num_gpus_seen != 1 else ''}"
    return (f"the engine replicas ask for {num_gpus_needed:g} GPUs in all, but Ray sees {seen} "
            "on this machine. Check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or lower "
            "--engine-num-gpus / --num-engine-replicas / --tensor-parallel-size (each rank "
            "of a replica takes --engine-num-gpus)")
