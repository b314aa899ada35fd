"""What crosses Ray between EngineReplica and Ingress, as plain msgpack-native data.

Ray serializes what a Serve call returns or streams with msgpack, and falls back
to cloudpickle (a new Pickler per item) for anything msgpack cannot pack
natively. Lists of ints, floats, strings and None pack natively, so every type
here is flattened to such lists at the boundary.

- `EngineRequest`: what the ingress asks an engine replica to run, validated once
  in the ingress. `owner` names the ingress replica whose per-step channel
  carries the request's deltas.
- A step message: one per engine step and ingress, a list of encoded deltas (one
  per request of that ingress that made progress). An empty message is the
  channel's greeting (it proves the channel reached its replica).
"""
from __future__ import annotations

from dataclasses import dataclass

from deltas.types import FinishReason, TokenDelta

_FINISH = {r.value: r for r in FinishReason}


@dataclass(slots=True, frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict  # the fields of replicas.config.SamplingParams
    owner: str  # the ingress channel id that receives this request's deltas

    def to_wire(self) -> list:
        # NOTE: tuples would not pack natively (Ray pickles them).
        params = {k: list(v) if isinstance(v, tuple) else v
                  for k, v in self.sampling_params.items()}
        return [self.request_id, self.prompt_token_ids, params, self.owner]

    @classmethod
    def from_wire(cls, item: list) -> "EngineRequest":
        request_id, prompt_token_ids, sampling_params, owner = item
        return cls(request_id, prompt_token_ids, sampling_params, owner)


def encode_delta(delta: TokenDelta) -> list:
    finish = delta.finish_reason
    top = delta.top_logprobs
    if top is not None:  # tuples would not pack natively (Ray pickles them)
        top = [[[t, lp] for t, lp in alts] for alts in top]
    return [delta.request_id, delta.token_ids, delta.logprobs, top,
            None if finish is None else finish.value, delta.stop_reason,
            delta.num_prompt_tokens, delta.num_output_tokens, delta.error]


def decode_delta(item: list) -> TokenDelta:
    request_id, token_ids, logprobs, top, finish, stop_reason, num_prompt, num_output, error = item
    if top is not None:
        top = [[(t, lp) for t, lp in alts] for alts in top]
    return TokenDelta(request_id, token_ids, logprobs, top,
                      None if finish is None else _FINISH[finish], stop_reason,
                      num_prompt, num_output, error)
