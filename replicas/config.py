"""Engine and sampling configuration: frozen plain data that checks itself.

Invalid values raise `InvalidValue` (a ValueError) naming the field and its
allowed range, so the ingress can turn them into a 400 without knowing the rules
twice.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from deltas.types import OutputKind
from replicas.quant.choice import QUANTIZATIONS

_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash-attn")
# The KV cache on CPU when kv_cache_gib is None: this many GiB, but no more than this
# share of the host memory still available at start-up, and never less than the
# floor (replicas/kv_cache/kv_budget.py).
CPU_KV_CACHE_GIB = 4.0
CPU_KV_CACHE_MEMORY_SHARE = 0.25
CPU_KV_CACHE_MIN_GIB = 1.0


class InvalidValue(ValueError):
    """A value its rule refuses. `param` names the field at fault; `code`, when
    set, says what kind of limit it hit (an OpenAI error code)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise InvalidValue(f"{name} must be {allowed}, got {value!r}", name)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _is_int64(v, low: int) -> bool:
    return _is_int(v) and low <= v <= INT64_MAX


# Every number the engine puts in a tensor must fit its dtype, and no accepted
# value may turn logits into NaN or Inf (float32 on the device): 1e-300 is 0 there.
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: as OpenAI, at most 300 entries of [-100, 100] each; a bias of 100 lifts a
# token above any logit a model gives (tens), -100 bans it, and both stay finite.
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
# temperature: below GREEDY_BELOW it is greedy; up to MIN_TEMPERATURE it is raised to
# it. With the repetition penalty's floor, a logit is scaled by at most 1e4: finite
# in float32 for any logit below 3e34 (models give tens).
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0
# top_p below this keeps only the top token anyway; float32 keeps it above 0.
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_PENALTY = 2.0  # presence, frequency


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Sampling settings of one request, checked and normalised on construction.

    Every range below is one the batched sampler can run for any row without
    NaN, Inf or integer overflow; error messages state it. Normalised (not
    refused): a temperature below 1e-5 is greedy (0) and one below 0.01 becomes
    0.01; top_p below 1e-6 becomes 1e-6 (still only the top token);
    repetition_penalty below 0.01 becomes 0.01. A top_k above the vocabulary
    means the whole vocabulary (the sampler clamps it). min_p and the presence
    and frequency penalties are safe over their whole ranges.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus top-k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_kind: OutputKind = OutputKind.DELTA
    # (token id, bias) pairs sorted by id; a dict {token id: bias} is accepted and
    # converted. Added to the logits before temperature, top-k and top-p.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What the output must match, as {kind: value} with one of json, json_object,
    # regex, choice, grammar (replicas/sampling/structured_output.py); the engine compiles it.
    structured_output: dict | None = None

    def __post_init__(self) -> None:
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", f"a number in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g}: "
               f"greedy; below {MIN_TEMPERATURE:g}: raised to {MIN_TEMPERATURE:g})",
               self.temperature)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        elif self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"a number in (0, 1] (below {MIN_TOP_P:g}: raised to {MIN_TOP_P:g})", self.top_p)
        object.__setattr__(self, "top_p", max(float(self.top_p), MIN_TOP_P))
        _check(self.top_k == -1 or _is_int64(self.top_k, 1), "top_k",
               "-1 (all) or an integer in [1, 2**63 - 1] (above the vocabulary size: the "
               "whole vocabulary)", self.top_k)
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               "min_p", "a number in [0, 1]", self.min_p)
        _check(self.seed is None or _is_int64(self.seed, 0),
               "seed", "null or an integer in [0, 2**63 - 1]", self.seed)
        _check(self.max_tokens is None or _is_int64(self.max_tokens, 1),
               "max_tokens", "null or an integer in [1, 2**63 - 1]", self.max_tokens)
        _check(_is_int64(self.min_tokens, 0),
               "min_tokens", "an integer in [0, 2**63 - 1]", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        ids = tuple(self.stop_token_ids or ())
        _check(len(ids) <= MAX_STOP_TOKEN_IDS and all(_is_int64(t, 0) for t in ids),
               "stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} integers in "
               "[0, vocabulary size)", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean", self.ignore_eos)
        _check(self.logprobs is None or (_is_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY, name,
                   f"a number in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]", value)
        _check(_is_num(self.repetition_penalty)
               and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}] (below "
               f"{MIN_REPETITION_PENALTY:g}: raised to {MIN_REPETITION_PENALTY:g})",
               self.repetition_penalty)
        object.__setattr__(self, "repetition_penalty",
                           max(float(self.repetition_penalty), MIN_REPETITION_PENALTY))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        check_structured_output(self.structured_output)
        if self.structured_output is not None and (self.ignore_eos or self.min_tokens):
            # NOTE: a complete grammar allows only EOS: banning it leaves no token at all
            raise InvalidValue("structured outputs end where their grammar ends: they do "
                               "not combine with ignore_eos or min_tokens > 0",
                               "structured_output")
        try:
            object.__setattr__(self, "output_kind", OutputKind(self.output_kind))
        except ValueError:
            raise InvalidValue(f"output_kind must be one of {[k.name for k in OutputKind]}, "
                               f"got {self.output_kind!r}", "output_kind") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def with_seed(self, seed: int) -> "SamplingParams":
        """A copy with another seed, checked alone: the n choices of one request differ
        only in their seeds, so the rest (a JSON schema included) is not checked again."""
        _check(_is_int64(seed, 0), "seed", "null or an integer in [0, 2**63 - 1]", seed)
        params = copy.copy(self)
        object.__setattr__(params, "seed", seed)
        return params


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    allowed = (f"a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (integers in [0, "
               f"vocabulary size)) to numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
    try:
        pairs = dict(bias or ())  # NOTE: pairs too, as they arrive from the wire
    except (TypeError, ValueError):
        raise InvalidValue(f"logit_bias must be {allowed}, got {bias!r}", "logit_bias") from None
    # NOTE: the message names the count or the first bad entry, not the whole map
    # (300 entries echoed back made a 4 KB message)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidValue(f"logit_bias must be {allowed}, got {len(pairs)} entries",
                           "logit_bias")
    bad = next(((t, b) for t, b in pairs.items() if not (
        _is_int64(t, 0) and _is_num(b) and abs(b) <= MAX_ABS_LOGIT_BIAS)), None)
    if bad is not None:
        raise InvalidValue(f"logit_bias must be {allowed}, got the entry {bad[0]!r}: "
                           f"{bad[1]!r}", "logit_bias")
    return tuple(sorted((t, float(b)) for t, b in pairs.items()))


# Each kind of structured output a client may send: what its value must be, and
# that rule in words.
_STRUCTURED_OUTPUT_KINDS = {
    "json": (lambda v: isinstance(v, dict), "a JSON schema object"),
    "json_object": (lambda v: v is True, "true"),
    "regex": (lambda v: isinstance(v, str), "a string"),
    "choice": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(c, str) for c in v),
               "a non-empty list of strings"),
    "grammar": (lambda v: isinstance(v, str), "a Lark grammar string"),
}
STRUCTURED_OUTPUT_KEYS = tuple(_STRUCTURED_OUTPUT_KINDS)
# ... and the form the ingress sends engines: llguidance's grammar text, checked
# once there (replicas/sampling/grammar_text.py), compiled by text, never re-checked.
_CHECKED_KINDS = {"llguidance": (lambda v: isinstance(v, str), "an llguidance grammar text")}


def check_structured_output(spec) -> None:
    """Shape only: the grammar itself is checked where the request enters (the
    ingress, replicas/sampling/grammar_text.py) or compiled (the engine), by
    llguidance, off any event loop."""
    if spec is None:
        return
    kinds = {**_STRUCTURED_OUTPUT_KINDS, **_CHECKED_KINDS}
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in kinds:
        raise InvalidValue("structured_output must be an object with exactly one of "
                           f"{list(STRUCTURED_OUTPUT_KEYS)}, got {spec!r:.200}", "structured_output")
    (key, value), = spec.items()
    is_valid, allowed = kinds[key]
    if not is_valid(value):
        raise InvalidValue(f"structured_output.{key} must be {allowed}", "structured_output")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = "tiny"  # a preset name ("tiny", "small") or a local HF directory
    # auto: on CPU bfloat16 for a bfloat16 or quantized checkpoint where the CPU runs it
    # natively, else float32; on CUDA the checkpoint's dtype
    # (replicas/checkpoints/dtype_choice.py); resolved and logged at start-up.
    dtype: str = "auto"
    # auto: a GGUF file's quantized matrices run as stored (CPU); none: dequantized at
    # load (the exact path); gguf: the file's own types, asked for (GPU); int8/int4:
    # float weights quantized at load (replicas/quant/choice.py); resolved and logged
    # at start-up.
    quantization: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    # KV budget (replicas/kv_cache/kv_budget.py): a fixed number of blocks wins. Else on CPU
    # kv_cache_gib (None: CPU_KV_CACHE_GIB, at most a share of the memory available); on
    # CUDA what gpu_memory_utilization of the device's memory leaves after the weights,
    # the peak of a profiling forward and the sampler's headroom, at most kv_cache_gib
    # when set (None: no cap).
    num_kv_blocks: int | None = None
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_scheduler_steps: int = 8
    async_output: bool = True
    # True: each decode step's tokens reach consumers as soon as the step is done;
    # False: only at the end of a multi-step window (the comparison baseline).
    release_per_step: bool = True
    attention_backend: str = "auto"  # auto | torch | cpu | triton | flash-attn
    enforce_eager: bool = False  # True: no CUDA graphs for decode
    seed: int = 0
    # Waiting-queue bounds; past them add_request raises EngineOverloaded.
    max_waiting_requests: int | None = None
    max_waiting_prompt_tokens: int | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU; None: leave as is
    # CPU, with num_threads below the cores: while every other engine replica on the
    # machine is idle and no other process wants a core, this one's steps run on all
    # the cores (replicas/idle_cores.py)
    use_idle_cores: bool = True
    # Reuse the K/V of full blocks of earlier prompts (shared system prompts, chat
    # turns); cached blocks stay until free blocks run out.
    enable_prefix_caching: bool = True
    # Ranks the model is split over (replicas/tensor_parallel/): one device each on
    # GPU, `num_threads` cores each on CPU; rank 0 schedules and samples.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model",
               "a preset name or a model directory", self.model)
        _check(self.dtype in _DTYPES, "dtype", f"one of {_DTYPES}", self.dtype)
        _check(self.quantization in QUANTIZATIONS, "quantization",
               f"one of {', '.join(QUANTIZATIONS)}", self.quantization)
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 1),
               "max_model_len", "null or an integer >= 1", self.max_model_len)
        _check(_is_int(self.block_size) and self.block_size >= 1
               and self.block_size & (self.block_size - 1) == 0,
               "block_size", "a power of two >= 1", self.block_size)
        _check(self.num_kv_blocks is None or (_is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1),
               "num_kv_blocks", "null or an integer >= 1", self.num_kv_blocks)
        _check(self.kv_cache_gib is None or (_is_num(self.kv_cache_gib) and self.kv_cache_gib > 0),
               "kv_cache_gib", "null or a number > 0", self.kv_cache_gib)
        _check(_is_num(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0,
               "gpu_memory_utilization", "a number in (0, 1]", self.gpu_memory_utilization)
        _check(_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 4096,
               "max_num_seqs", "an integer in [1, 4096]", self.max_num_seqs)
        _check(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 16,
               "max_num_batched_tokens", "an integer >= 16", self.max_num_batched_tokens)
        _check(_is_int(self.num_scheduler_steps) and 1 <= self.num_scheduler_steps <= 64,
               "num_scheduler_steps", "an integer in [1, 64]", self.num_scheduler_steps)
        _check(isinstance(self.async_output, bool), "async_output", "a boolean", self.async_output)
        _check(isinstance(self.release_per_step, bool), "release_per_step", "a boolean",
               self.release_per_step)
        _check(isinstance(self.enforce_eager, bool), "enforce_eager", "a boolean", self.enforce_eager)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "a boolean",
               self.enable_prefix_caching)
        _check(isinstance(self.use_idle_cores, bool), "use_idle_cores", "a boolean",
               self.use_idle_cores)
        _check(self.attention_backend in ATTENTION_BACKENDS,
               "attention_backend", f"one of {', '.join(ATTENTION_BACKENDS)}",
               self.attention_backend)
        _check(_is_int(self.tensor_parallel_size) and 1 <= self.tensor_parallel_size <= 64,
               "tensor_parallel_size", "an integer in [1, 64]", self.tensor_parallel_size)
        for name in ("max_waiting_requests", "max_waiting_prompt_tokens", "num_threads"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and v >= 1), name, "null or an integer >= 1", v)
