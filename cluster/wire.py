"""The chunk format between EngineReplica and Ingress: a TokenDelta as a plain list.

Ray serializes a streamed item with msgpack, and falls back to cloudpickle (a
new Pickler per item) for anything msgpack cannot pack natively. A list of ints,
floats, strings and None packs natively, which made the replica's per-chunk
cost several times smaller than sending the TokenDelta object. The request id
is not sent: the ingress knows which stream a chunk belongs to.
"""
from __future__ import annotations

from deltas.types import FinishReason, TokenDelta

_FINISH = {r.value: r for r in FinishReason}


def encode_delta(delta: TokenDelta) -> list:
    finish = delta.finish_reason
    top = delta.top_logprobs
    if top is not None:  # tuples would not pack natively (Ray pickles them)
        top = [[[t, lp] for t, lp in alts] for alts in top]
    return [delta.token_ids, delta.logprobs, top,
            None if finish is None else finish.value, delta.stop_reason,
            delta.num_prompt_tokens, delta.num_output_tokens, delta.error]


def decode_delta(request_id: str, item: list) -> TokenDelta:
    token_ids, logprobs, top, finish, stop_reason, num_prompt, num_output, error = item
    if top is not None:
        top = [[(t, lp) for t, lp in alts] for alts in top]
    return TokenDelta(request_id, list(token_ids), logprobs, top,
                      None if finish is None else _FINISH[finish], stop_reason,
                      num_prompt, num_output, error)
