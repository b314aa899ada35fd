"""The offline engine API (tests, benchmarks):

    from replicas import Engine, EngineConfig, SamplingParams
    Engine(EngineConfig(model="tiny")).generate(prompts, params)

`prompts` are token-id lists, or strings when the model directory has a tokenizer.
Results come back in prompt order with `.token_ids` (and `.text`).
"""
from __future__ import annotations

import itertools
import os
from typing import Sequence

from deltas.types import FinishReason
from replicas.config import EngineConfig, SamplingParams
from replicas.engine_core import EngineCore
from replicas.engine_stats import EngineStats
from replicas.offline_outputs import CollectingSink, RequestOutput


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config or EngineConfig(**kwargs)
        self.core = EngineCore(self.config)
        self._ids = itertools.count()
        self._tokenizer = None
        self._outputs: dict[str, RequestOutput] = {}

    @property
    def tokenizer(self):
        """The model's tokenizer (deltas.tokenization.tokenizer.Tokenizer), or None without one."""
        if self._tokenizer is None and os.path.isfile(os.path.join(self.core.model_dir, "tokenizer.json")):
            from deltas.tokenization.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_dir(self.core.model_dir)
        return self._tokenizer

    # -- request-level API ----------------------------------------------------
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"offline-{next(self._ids)}"
        ids = self._encode(prompt)
        out = RequestOutput(request_id, ids)
        sink = CollectingSink(out)
        req = self.core.make_request(request_id, ids, params or SamplingParams(), sink)
        self.core.add_request(req)
        self._outputs[request_id] = out
        return request_id

    def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id, FinishReason.ABORT)

    def step(self) -> bool:
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_work

    def output(self, request_id: str) -> RequestOutput:
        return self._outputs[request_id]

    def generate(self, prompts: Sequence[list[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        request_ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.core.has_work:
            self.core.step()
        self.core.output.wait()
        outs = [self._outputs.pop(r) for r in request_ids]
        if self.tokenizer is not None:
            for o in outs:
                o.text = self.tokenizer.decode(o.token_ids)
        return outs

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return prompt

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
