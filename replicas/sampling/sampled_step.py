"""One engine step's sampled tokens on the host, from the model runner to the
output processor: named lists, one entry per sampled row.

The device packs a step into one tensor so that the step costs one host copy
(`replicas.sampling.sampler.sample_no_sync`): the ids alone, or per row
`[id, logprob, top ids..., top logprobs...]` as float32 when any row asked for
logprobs. `StepOutput.from_host` unpacks that copy once, here, so no consumer
has to know the layout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StepOutput:
    token_ids: list[int]  # the sampled id of each row
    # None when no row of the step asked for logprobs; else one per row.
    logprobs: list[float] | None = None
    # Per row, the step's widest top-k (rows that asked fewer take a prefix);
    # None when no row asked for top logprobs.
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        # Lengths only: this runs once per step on the hot path.
        n = len(self.token_ids)
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError(f"logprobs must have one entry per row ({n}), "
                             f"got {len(self.logprobs)}")
        if (self.top_ids is None) != (self.top_logprobs is None):
            raise ValueError("top_ids and top_logprobs come together")
        if self.top_ids is not None:
            if self.logprobs is None:
                raise ValueError("top logprobs need the sampled tokens' logprobs")
            if len(self.top_ids) != n or len(self.top_logprobs) != n:
                raise ValueError(f"top_ids and top_logprobs must have one entry per row ({n})")

    @property
    def has_logprobs(self) -> bool:
        return self.logprobs is not None

    @classmethod
    def from_host(cls, rows: list) -> "StepOutput":
        """From the host copy (`tolist()`) of the packed sample tensor."""
        if not rows or not isinstance(rows[0], list):
            return cls(rows)  # ids alone (int64): nothing to unpack
        token_ids = [int(r[0]) for r in rows]  # exact in float32 below 2**24
        logprobs = [r[1] for r in rows]
        width = (len(rows[0]) - 2) // 2
        if width == 0:
            return cls(token_ids, logprobs)
        return cls(token_ids, logprobs,
                   [[int(t) for t in r[2:2 + width]] for r in rows],
                   [r[2 + width:2 + 2 * width] for r in rows])
