"""Structured outputs: a grammar per constrained request, and its next token mask.

A request's `SamplingParams.structured_output` holds one of `json` (a JSON
schema), `json_object` (true: any JSON object), `regex`, `choice` (a list of
strings), `grammar` (Lark), or `llguidance`: the grammar text the ingress
already converted and checked (replicas/sampling/grammar_text.py). The engine
compiles it with llguidance against the model's own tokenizer.json when it builds
the request, in worker lanes (replicas/sampling/compile_lanes.py) whose time limit
`COMPILE_TIMEOUT_S` counts the compile alone, not its wait: an invalid or too
costly grammar is an `InvalidValue` (a 400 at the ingress), never a hung engine.
A compiled grammar is kept by its text (`CompiledGrammars`): the `n` choices of a
request, and later requests with the same schema, start from a copy of it.

Invariant: before a constrained row is sampled, its matcher has consumed every
one of the row's output tokens (EngineCore._on_step feeds it each token right
after the step's host sync), so the mask always comes from the previous token.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from replicas.config import InvalidValue
from replicas.sampling.compile_lanes import CompileLanes, LanesBusy, TooSlow
from replicas.sampling.grammar_text import checked_grammar_text, grammar_text

COMPILE_TIMEOUT_S = 2.0
# Compiled grammars kept, by their text: at most this many, of this many characters
# of text in all (a compiled grammar's memory grows with its text).
MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_CHARS = 64 * 1024 * 1024
_PARAM = "structured_output"
logger = logging.getLogger("stepstream")

__all__ = ["COMPILE_TIMEOUT_S", "GrammarBatch", "GrammarCompiler", "GrammarMatcher",
           "LanesBusy", "grammar_text"]


class CompiledGrammars:
    """Matchers in their start state, by grammar text, least recently used out first."""

    def __init__(self, max_entries: int = MAX_CACHED_GRAMMARS,
                 max_chars: int = MAX_CACHED_GRAMMAR_CHARS) -> None:
        self._matchers: OrderedDict[str, object] = OrderedDict()
        self._num_chars = 0
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._lock = threading.Lock()  # NOTE: compiles put from worker threads

    def __len__(self) -> int:
        return len(self._matchers)

    def get(self, text: str):
        with self._lock:
            matcher = self._matchers.get(text)
            if matcher is not None:
                self._matchers.move_to_end(text)
            return matcher

    def put(self, text: str, matcher) -> None:
        if len(text) > self._max_chars:
            return
        with self._lock:
            if text in self._matchers:
                return
            self._matchers[text] = matcher
            self._num_chars += len(text)
            while len(self._matchers) > self._max_entries or self._num_chars > self._max_chars:
                old, _ = self._matchers.popitem(last=False)
                self._num_chars -= len(old)


class GrammarCompiler:
    """One per engine: the model's token table, built once at start-up, and the
    grammars compiled against it."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int]):
        import llguidance as llg
        self._llg = llg
        path = Path(model_dir) / "tokenizer.json"
        self.tokenizer = None
        if path.is_file() and eos_token_ids:
            try:
                self.tokenizer = llg.LLTokenizer(path.read_text(), n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
            except Exception:  # noqa: BLE001 - serve without structured outputs
                logger.exception("structured outputs are off: llguidance cannot read %s", path)
        self.compiled = CompiledGrammars()
        self._lanes = CompileLanes("grammar-compile")

    def compile(self, spec: dict, timeout_s: float = COMPILE_TIMEOUT_S) -> "GrammarMatcher":
        """A fresh matcher for a spec whose shape SamplingParams checked, waited for
        here; raises InvalidValue naming the problem (LanesBusy when every worker is)."""
        text = self._text(spec)
        start = self.compiled.get(text)
        if start is None:
            try:
                start = self._lanes.run(text, len(text), lambda: self._compile(text), timeout_s)
            except TooSlow:
                raise _too_slow(timeout_s) from None
        return GrammarMatcher(start.deep_copy())

    async def compile_async(self, spec: dict,
                            timeout_s: float = COMPILE_TIMEOUT_S) -> "GrammarMatcher":
        """The same, awaited: an engine replica admits on its event loop, which must
        not stop while a schema compiles (every stream of the replica would wait)."""
        (key, _), = spec.items()
        # NOTE: a spec not checked at an ingress is converted and checked off the loop
        text = self._text(spec) if key == "llguidance" else await asyncio.to_thread(
            self._text, spec)
        start = self.compiled.get(text)
        if start is None:
            try:
                start = await self._lanes.run_async(text, len(text),
                                                    lambda: self._compile(text), timeout_s)
            except TooSlow:
                raise _too_slow(timeout_s) from None
        return GrammarMatcher(start.deep_copy())

    def _text(self, spec: dict) -> str:
        if self.tokenizer is None:
            raise InvalidValue("structured outputs need the model's tokenizer.json and an "
                               "end-of-sequence token", _PARAM)
        (key, _), = spec.items()
        # NOTE: the ingress's text was checked there; a spec given to the engine
        # directly (the offline engine) is checked here, once, by the same rule.
        return grammar_text(spec) if key == "llguidance" else checked_grammar_text(spec)

    def _compile(self, text: str):
        """A matcher in its start state (run in a lane's worker), kept by its text."""
        matcher = self._llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            # NOTE: the first line only: a limit llguidance asserts comes with its backtrace
            error = matcher.get_error().strip().split("\n", 1)[0][:500]
            raise InvalidValue(f"{_PARAM} does not compile: {error}", _PARAM)
        self.compiled.put(text, matcher)
        return matcher


def _too_slow(timeout_s: float) -> InvalidValue:
    # NOTE: a compile past its time cannot be killed; llguidance's fuel limits end it
    # (and, done, it is kept: the same grammar asked again starts from it).
    return InvalidValue(f"{_PARAM} could not be compiled within {timeout_s:g} s; "
                        "simplify the schema or grammar", _PARAM)


class GrammarMatcher:
    """One request's parse state; fed each sampled token, in order.

    A token the grammar rejects (its mask left none allowed) or a matcher error
    (llguidance's limits) ends the request with an error at that token, never a
    silent stop: `accept` says why, once, and the step's output processing fails
    the request there."""

    __slots__ = ("matcher", "failed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.failed = False

    def accept(self, token_id: int, num_output_tokens: int) -> str | None:
        """Feed a sampled token; why the grammar failed on it, the first time it does."""
        if self.failed:
            return None
        matcher = self.matcher
        # NOTE: once stopped (EOS consumed, or an error) any later token is one the
        # engine drops (a window's extra steps), so it is not fed to the matcher.
        ok = matcher.consume_token(token_id) if not matcher.is_stopped() else True
        if ok and not matcher.is_error():
            return None
        self.failed = True
        # NOTE: the first line only: llguidance's parser errors append its whole state
        error = (matcher.get_error() or "token rejected").strip().split("\n", 1)[0][:500]
        return (f"the structured output's grammar failed at output token {num_output_tokens}: "
                f"{error}")


class GrammarBatch:
    """The constrained rows of one decision, and their masks on the host."""

    _executor = None

    def __init__(self, row_indices: list[int], matchers: list[GrammarMatcher], vocab_size: int,
                 device: torch.device):
        import llguidance.torch as llt
        self._llt = llt
        if GrammarBatch._executor is None:
            import llguidance as llg
            GrammarBatch._executor = llg.LLExecutor()
        self.pairs = [(g.matcher, i) for i, g in enumerate(matchers)]
        self.rows = torch.tensor(row_indices, dtype=torch.int64, device=device)
        self.bitmask = llt.allocate_token_bitmask(len(matchers), vocab_size)
        self.byte_bias = _byte_bias_table(device)

    @classmethod
    def from_rows(cls, rows, vocab_size: int, device: torch.device) -> "GrammarBatch | None":
        picked = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
        if not picked:
            return None
        return cls([i for i, _ in picked], [g for _, g in picked], vocab_size, device)

    def mask_logits_(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf, for constrained rows.

        NOTE: computes every mask on the host now, from the matchers' current state.
        """
        self._llt.fill_next_token_bitmask_par(self._executor, self.pairs, self.bitmask)
        num_rows, vocab_size = len(self.pairs), logits.shape[1]
        # NOTE: one gather of 8 biases per mask byte: 5x cheaper on CPU than
        # unpacking bits with shifts (0.17 vs 2.6 ms for 50 rows of 8,192 tokens).
        mask_bytes = self.bitmask.view(torch.uint8).to(self.rows.device, non_blocking=True)
        bias = self.byte_bias.index_select(0, mask_bytes.view(-1).long())  # (C * V / 8, 8)
        logits.index_add_(0, self.rows, bias.view(num_rows, -1)[:, :vocab_size])


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}


def _byte_bias_table(device: torch.device) -> torch.Tensor:
    """(256, 8): for each mask byte, 0 for an allowed token and -inf for a banned one.

    NOTE: bit k of byte j of a row is token 8 * j + k (llguidance's little-endian
    32-bit words viewed as bytes)."""
    table = _BYTE_BIAS.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
        _BYTE_BIAS[device] = table
    return table
