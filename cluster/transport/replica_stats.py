"""An engine replica's figures, typed from the engine to the metrics.

`EngineReplica` counts what its calls did in `ReplicaCounts` and snapshots them,
with the engine's `EngineStats` (replicas/engine_stats.py), into one
`ReplicaStats`: its stats thread hands that to `cluster.metrics.ReplicaMetrics`,
which reads every figure by field name. Callers through a Serve handle (tools,
tests) get `as_dict()`, keyed by the same field names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.engine_stats import EngineStats


@dataclass(slots=True)
class ReplicaCounts:
    """Totals since the replica started: incremented on the event loop only; the
    stats thread copies them (reads only)."""

    num_requests_admitted: int = 0
    num_requests_refused: int = 0
    num_requests_finished: int = 0
    num_requests_cancelled: int = 0
    num_requests_orphaned: int = 0
    num_channels_opened: int = 0
    num_step_messages_sent: int = 0
    num_deltas_sent: int = 0


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    engine: EngineStats
    counts: ReplicaCounts  # a copy: later counting does not change it
    replica_id: str
    num_outboxes: int  # ingress replicas with an outbox on this replica

    def as_dict(self) -> dict:
        return {**self.engine.as_dict(), **dataclasses.asdict(self.counts),
                "replica_id": self.replica_id, "num_outboxes": self.num_outboxes}
