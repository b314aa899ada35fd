"""The engine: token ids in, token deltas out. Knows nothing of HTTP or text
(text only through `deltas/`).

`from replicas import Engine, EngineConfig, SamplingParams`. Engine classes load
lazily so that `replicas.config` and `replicas.checkpoints.presets` import without torch.
"""
from replicas.config import EngineConfig, SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineOverloaded", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from replicas.offline_engine import Engine
        return Engine
    if name in ("AsyncEngine", "EngineOverloaded", "EngineDeadError"):
        from replicas import async_engine
        return getattr(async_engine, name)
    raise AttributeError(f"module 'replicas' has no attribute {name!r}")
