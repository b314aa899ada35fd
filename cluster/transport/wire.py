"""What crosses Ray between the Ingress and an EngineReplica, declared once.

Serve's by-value transport (handles with `_by_reference=False`, over gRPC) pickles
every call argument and every streamed item. So each message crosses as one
`bytes` object, encoded by msgspec from the typed declarations below: pickling
bytes is a copy, and msgspec encodes and decodes in C, with no Python code per
field. Structs are array-like: fields travel by position and are named only here.

| message | from -> to | type |
|---|---|---|
| request | ingress -> replica (`generate`) | `EngineRequest` |
| admission answer | replica -> ingress | the replica's id (`str`), then nothing until the request ends |
| step message | replica -> ingress (`channel`) | `list[TokenDelta]` (`deltas/types.py`), one per request of that ingress that made progress in the step |
| greeting | replica -> ingress (`channel`) | an empty step message: the channel reached its replica |

Decoding checks every field's type; a request's `SamplingParams` run their own
`__post_init__` on decode, so a replica refuses a bad value with the same rule
and message as the ingress.
"""
from __future__ import annotations

import msgspec

from deltas.types import TokenDelta
from replicas.config import SamplingParams  # plain data: no torch


class EngineRequest(msgspec.Struct, array_like=True, frozen=True):
    """What the ingress asks an engine replica to run, validated where it entered
    (cluster/api/ingress.py)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    owner: str  # the ingress channel id that receives this request's deltas


class _PromptView(msgspec.Struct, array_like=True):
    """The leading fields of an `EngineRequest`: the router reads the prompt
    without decoding the rest."""

    request_id: str
    prompt_token_ids: list[int]


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
_prompt_decoder = msgspec.msgpack.Decoder(_PromptView)
_step_decoder = msgspec.msgpack.Decoder(list[TokenDelta])


def encode_request(request: EngineRequest) -> bytes:
    return _encoder.encode(request)


def decode_request(data: bytes) -> EngineRequest:
    """Raises `msgspec.ValidationError` (a ValueError) naming the bad field."""
    return _request_decoder.decode(data)


def prompt_of(data: object) -> list[int] | None:
    """The prompt ids of an encoded `EngineRequest`; None for anything else."""
    if not isinstance(data, bytes):
        return None
    try:
        return _prompt_decoder.decode(data).prompt_token_ids
    except msgspec.DecodeError:
        return None


def encode_step(deltas: list[TokenDelta]) -> bytes:
    return _encoder.encode(deltas)


def decode_step(data: bytes) -> list[TokenDelta]:
    return _step_decoder.decode(data)


GREETING = encode_step([])
