"""The per-step wire's cost: encode + decode of one step message, by format.

A step message carries one `TokenDelta` per request of one ingress that made
progress in the step (cluster/transport/wire.py). Serve's by-value transport pickles what a
channel streams (cloudpickle), so every format is timed through that pickling too:

- **lists**: each delta as a positional list of plain values (fields by index),
  the message a list of those lists;
- **structs**: the `TokenDelta` structs themselves, pickled;
- **msgspec**: the message as msgspec bytes (`encode_step` / `decode_step`), what
  the channel sends.

Formats are interleaved sample by sample; medians over the samples are printed
(microseconds per message). Machines differ: compare the rows of one run.
"""
from __future__ import annotations

import pickle
import statistics
import time
from typing import Callable

from deltas.types import FinishReason, TokenDelta
from loadtests.metrics import format_table

_FINISH = {r.value: r for r in FinishReason}


def _list_encode(deltas: list[TokenDelta]) -> list:
    out = []
    for d in deltas:
        top = d.top_logprobs
        if top is not None:
            top = [[[t, lp] for t, lp in alts] for alts in top]
        finish = d.finish_reason
        out.append([d.request_id, d.token_ids, d.logprobs, top,
                    None if finish is None else finish.value, d.stop_reason,
                    d.num_prompt_tokens, d.num_output_tokens, d.error])
    return out


def _list_decode(message: list) -> list[TokenDelta]:
    out = []
    for item in message:
        request_id, token_ids, logprobs, top, finish, stop_reason, num_prompt, num_output, error = item
        if top is not None:
            top = [[(t, lp) for t, lp in alts] for alts in top]
        out.append(TokenDelta(request_id, token_ids, logprobs, top,
                              None if finish is None else _FINISH[finish], stop_reason,
                              num_prompt, num_output, error))
    return out


def _formats() -> dict[str, tuple[Callable, Callable]]:
    """name -> (encode: deltas -> what crosses, decode: what crossed -> deltas),
    each through the transport's pickling."""
    from ray import cloudpickle

    from cluster.transport.wire import decode_step, encode_step

    dumps, loads = cloudpickle.dumps, pickle.loads
    return {
        "lists": (lambda ds: dumps(_list_encode(ds)), lambda b: _list_decode(loads(b))),
        "structs": (lambda ds: dumps(ds), lambda b: loads(b)),
        "msgspec": (lambda ds: dumps(encode_step(ds)), lambda b: decode_step(loads(b))),
    }


def step_deltas(num_deltas: int, num_tokens: int, step: int = 100) -> list[TokenDelta]:
    """One step's deltas: `num_deltas` requests, `num_tokens` new tokens each."""
    return [TokenDelta(f"cmpl-{i:032x}", [(i * 7919 + step * 31 + k) % 8192
                                          for k in range(num_tokens)],
                       num_prompt_tokens=128, num_output_tokens=step + num_tokens)
            for i in range(num_deltas)]


def _time_us(fn: Callable, arg, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(arg)
    return (time.perf_counter() - start) * 1e6 / number


def measure(num_deltas: int, num_tokens: int, num_samples: int = 30,
            number: int = 20) -> dict[str, dict]:
    """Median encode and decode microseconds per message, and its size, by format."""
    formats = _formats()
    deltas = step_deltas(num_deltas, num_tokens)
    wires = {name: enc(deltas) for name, (enc, _) in formats.items()}
    for name, (_, dec) in formats.items():
        assert dec(wires[name]) == deltas, name  # every format round-trips
    samples = {name: ([], []) for name in formats}
    for _ in range(num_samples):
        for name, (enc, dec) in formats.items():
            samples[name][0].append(_time_us(enc, deltas, number))
            samples[name][1].append(_time_us(dec, wires[name], number))
    return {name: {"bytes": len(wires[name]),
                   "encode_us": statistics.median(enc_us),
                   "decode_us": statistics.median(dec_us)}
            for name, (enc_us, dec_us) in samples.items()}


def report(num_deltas: int, tokens: list[int], num_samples: int) -> dict[str, dict]:
    """Print one table, a row per message size and format; return the rows by message."""
    out, shown = {}, {}
    for num_tokens in tokens:
        rows = out[f"{num_deltas} x {num_tokens}"] = measure(num_deltas, num_tokens, num_samples)
        base = rows["lists"]["encode_us"] + rows["lists"]["decode_us"]
        label = f"{num_deltas} x {num_tokens} token{'s' if num_tokens > 1 else ''}"
        for name, row in rows.items():
            total = row["encode_us"] + row["decode_us"]
            shown[f"{label}, {name}"] = {**row, "total_us": total, "vs_lists": total / base}
    print(format_table(shown, [("bytes", "bytes", "d"), ("encode_us", "encode us", ".1f"),
                               ("decode_us", "decode us", ".1f"), ("total_us", "total us", ".1f"),
                               ("vs_lists", "vs lists", ".2f")], name_header="message, format"))
    return out
