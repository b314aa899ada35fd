"""The engine's load figures, as the engine thread last published them.

NOTE: stats and the AsyncEngine's admission bounds are read on the asyncio
thread while the engine thread changes the scheduler's queues and the block
manager. Rather than read those containers across threads, the engine thread
builds one frozen `EngineStats` after each change (an add, an abort, a step) and
swaps it in with a single attribute assignment; a reader gets a consistent view
that is at most one step old. Readers (the replica's metrics, tests, benchmarks)
read its fields by name: a renamed field fails where it is read, never reads 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from replicas.kv_cache.block_manager import BlockManager
from replicas.scheduler import Scheduler


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_prefix_cache_hit_tokens: int
    num_prefix_cache_query_tokens: int
    num_cached_blocks: int
    num_active_streams: int  # the AsyncEngine's open streams (0 in the engine's own snapshot)

    @classmethod
    def from_engine(cls, scheduler: Scheduler, block_manager: BlockManager,
                    num_steps: int) -> EngineStats:
        """Engine thread only: reads the live queues and block pools."""
        bm = block_manager
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_waiting_prompt_tokens=scheduler.num_waiting_prompt_tokens,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            num_steps=num_steps,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_hit_rate=scheduler.prefix_cache_hit_rate,
            num_prefix_cache_hit_tokens=scheduler.num_prefix_cache_hit_tokens,
            num_prefix_cache_query_tokens=scheduler.num_prefix_cache_query_tokens,
            num_cached_blocks=bm.num_cached_blocks,
            num_active_streams=0,
        )

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting

    def with_active_streams(self, num_active_streams: int) -> EngineStats:
        return dataclasses.replace(self, num_active_streams=num_active_streams)

    def as_dict(self) -> dict:
        """By field name, for callers across a Serve handle (tools, tests)."""
        return dataclasses.asdict(self)
