"""Benchmark prompts: a random dataset of given lengths, or a ShareGPT-format JSON file
(and the writer of the bundled synthetic sample, `python -m loadtests.bench sharegpt-sample`).

A tokenizer is any object with `encode(text) -> list[int]` and `decode(ids) -> str`
(`load_tokenizer` wraps a Hugging Face tokenizer.json). Without one, prompts are
built from words and lengths are counted in words, an approximation that keeps the
tools usable against any server.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

DEFAULT_SHAREGPT_PATH = Path(__file__).parents[1] / "data" / "sharegpt_sample.json"

# vLLM's ShareGPT filter (benchmarks/benchmark_dataset.py: is_valid_sequence).
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_FALLBACK_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his "
    "from at which but have an they you were her she there been one all we their "
    "has would when if so no will more can out up about into them some could time "
    "only other new see over make like than then now these two may first well way "
    "model token stream server cluster request batch step window chunk latency"
).split()


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True, frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


class HFTokenizer:
    """A tokenizer.json through the `tokenizers` library; never adds special tokens."""

    __slots__ = ("_tok", "vocab_size", "special_ids")

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(self._tok.get_added_tokens_decoder())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str | Path | None) -> HFTokenizer | None:
    return HFTokenizer(path) if path else None


def count_tokens(text: str, tokenizer: TokenizerLike | None) -> int:
    return len(tokenizer.encode(text)) if tokenizer is not None else len(text.split())


# ---- random dataset -------------------------------------------------------------

def _lengths(rng: np.random.RandomState, target: int, range_ratio: float, n: int) -> np.ndarray:
    low = max(1, int(target * (1 - range_ratio)))
    high = max(low, int(target * (1 + range_ratio)))
    return rng.randint(low, high + 1, size=n)


def _word_text(rng: np.random.RandomState, num_words: int) -> str:
    """Words drawn from a fixed list: prompts without a tokenizer, lengths in words."""
    return " ".join(_FALLBACK_WORDS[j] for j in rng.randint(0, len(_FALLBACK_WORDS), size=num_words))


def _usable_ids(tokenizer: TokenizerLike) -> list[int]:
    """Ids that survive decode -> encode alone: no special tokens, no partial UTF-8."""
    vocab_size = getattr(tokenizer, "vocab_size", None) or 256
    special = getattr(tokenizer, "special_ids", frozenset())
    usable = [i for i in range(vocab_size)
              if i not in special and tokenizer.encode(tokenizer.decode([i])) == [i]]
    return usable or [i for i in range(vocab_size) if i not in special]


def _token_prompt(tokenizer: TokenizerLike, ids: list[int], target_len: int) -> tuple[str, int]:
    """Decode ids, re-encode and trim until the text tokenizes to ~target_len.

    N ids do not always decode to a text that encodes back to N tokens (merges
    across boundaries), so the measured length is what we report, as vLLM does.
    """
    text = tokenizer.decode(ids)
    for _ in range(4):
        re_ids = tokenizer.encode(text)
        if len(re_ids) == target_len:
            break
        if len(re_ids) > target_len:
            re_ids = re_ids[:target_len]
        else:
            re_ids = re_ids + ids[: target_len - len(re_ids)]
        text = tokenizer.decode(re_ids)
    return text, len(tokenizer.encode(text))


def sample_random_requests(num_prompts: int, input_len: int, output_len: int,
                           tokenizer: TokenizerLike | None = None,
                           range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Prompts of ~input_len tokens (words without a tokenizer), fixed output_len."""
    rng = np.random.RandomState(seed)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    if tokenizer is None:
        return [SampleRequest(_word_text(rng, int(n)), int(n), int(out))
                for n, out in zip(input_lens, output_lens)]
    usable = np.asarray(_usable_ids(tokenizer))
    for i in range(num_prompts):
        n = int(input_lens[i])
        # NOTE: independent random ids per prompt: no shared prefix for a cache to hit.
        ids = usable[rng.randint(0, len(usable), size=n)].tolist()
        prompt, measured_len = _token_prompt(tokenizer, ids, n)
        requests.append(SampleRequest(prompt, measured_len, int(output_lens[i])))
    return requests


# ---- ShareGPT ---------------------------------------------------------------------

def is_valid_sequence(prompt_len: int, output_len: int, check_output_min: bool = True) -> bool:
    output_too_short = check_output_min and output_len < MIN_SEQ_LEN
    return not (prompt_len < MIN_SEQ_LEN or output_too_short
                or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN)


def _turns(path: str | Path) -> list[list[tuple[str, str]]]:
    """Every conversation as (human message, recorded reply) pairs."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    messages = ([m["value"] for m in c.get("conversations", ())] for c in data)
    return [list(zip(m[0::2], m[1::2])) for m in messages]


def load_sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with a reply."""
    return [turns[0] for turns in _turns(path) if turns]


def sample_sharegpt_requests(path: str | Path | None, num_prompts: int,
                             tokenizer: TokenizerLike | None = None,
                             fixed_output_len: int | None = None,
                             seed: int = 0) -> list[SampleRequest]:
    """Shuffled, filtered as vLLM filters; repeats the pool when it runs short."""
    pairs = load_sharegpt_pairs(path or DEFAULT_SHAREGPT_PATH)
    random.Random(seed).shuffle(pairs)
    pool: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(pool) == num_prompts:
            break
        prompt_len = count_tokens(prompt, tokenizer)
        output_len = fixed_output_len or count_tokens(completion, tokenizer)
        if not is_valid_sequence(prompt_len, output_len, fixed_output_len is None):
            continue
        pool.append(SampleRequest(prompt, prompt_len, output_len))
    if not pool:
        raise ValueError(f"no usable conversation in {path}")
    # NOTE: a small sample file may hold fewer usable prompts than asked; cycle it.
    return [pool[i % len(pool)] for i in range(num_prompts)]


# ---- shared prefix ----------------------------------------------------------------

def sample_prefix_requests(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                           tokenizer: TokenizerLike | None = None, num_prefixes: int = 1,
                           seed: int = 0) -> list[SampleRequest]:
    """Prompts made of a shared prefix (a system prompt of ~prefix_len tokens; words
    without a tokenizer) and a unique suffix of ~suffix_len; request i uses prefix
    i % num_prefixes. What a prefix cache is for."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1:
        raise ValueError("num_prefixes and suffix_len must be >= 1, prefix_len >= 0")
    rng = np.random.RandomState(seed)
    if tokenizer is None:
        prefixes = [_word_text(rng, prefix_len) for _ in range(num_prefixes)]
        return [SampleRequest(f"{prefixes[i % num_prefixes]}\n{_word_text(rng, suffix_len)}",
                              prefix_len + suffix_len, output_len) for i in range(num_prompts)]
    usable = np.asarray(_usable_ids(tokenizer))
    draw = lambda n: usable[rng.randint(0, len(usable), size=n)].tolist()  # noqa: E731
    # NOTE: a newline between prefix and suffix is a token boundary for byte-level
    # BPE, so every prompt tokenizes its prefix to the same ids.
    prefixes = [_token_prompt(tokenizer, draw(prefix_len), prefix_len)[0] if prefix_len else ""
                for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        suffix, _ = _token_prompt(tokenizer, draw(suffix_len), suffix_len)
        prompt = f"{prefixes[i % num_prefixes]}\n{suffix}"
        requests.append(SampleRequest(prompt, count_tokens(prompt, tokenizer), output_len))
    return requests


# ---- multi-turn chat replay ---------------------------------------------------------

def load_sharegpt_conversations(path: str | Path) -> list[list[tuple[str, str]]]:
    """Every conversation with >= 2 turns, as (human message, recorded reply) pairs."""
    return [turns for turns in _turns(path) if len(turns) >= 2]


def conversation_prompts(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(prompt, recorded reply) per turn. Turn k's prompt is turn k-1's prompt, its
    recorded reply and the next message: each prompt extends the one before."""
    prompts, transcript = [], ""
    for message, reply in turns:
        transcript += f"User: {message}\nAssistant:"
        prompts.append((transcript, reply))
        transcript += f" {reply}\n"
    return prompts


def sample_multiturn_requests(path: str | Path | None, num_prompts: int,
                              tokenizer: TokenizerLike | None = None,
                              fixed_output_len: int | None = None,
                              seed: int = 0) -> list[SampleRequest]:
    """A replay of multi-turn ShareGPT conversations (the recorded replies, not the
    model's, go into later turns). Ordered turn by turn: every conversation's first
    turn, then every second turn, ..., so a turn is sent after the one before it.
    A conversation ends at its first turn that vLLM's length filter rejects."""
    conversations = load_sharegpt_conversations(path or DEFAULT_SHAREGPT_PATH)
    random.Random(seed).shuffle(conversations)
    picked: list[list[SampleRequest]] = []
    num_turns = 0
    for turns in conversations:
        if num_turns >= num_prompts:
            break
        kept = []
        for prompt, reply in conversation_prompts(turns):
            prompt_len = count_tokens(prompt, tokenizer)
            output_len = fixed_output_len or count_tokens(reply, tokenizer)
            if not is_valid_sequence(prompt_len, output_len, fixed_output_len is None):
                break
            kept.append(SampleRequest(prompt, prompt_len, output_len))
        if len(kept) >= 2:
            picked.append(kept)
            num_turns += len(kept)
    if not picked:
        raise ValueError(f"no usable multi-turn conversation in {path}")
    ordered = [c[k] for k in range(max(map(len, picked))) for c in picked if k < len(c)]
    # NOTE: a small sample file may hold fewer turns than asked; cycle it.
    return [ordered[i % len(ordered)] for i in range(num_prompts)]


# ---- the bundled sample: synthetic ShareGPT-format conversations ---------------------
# No downloads. Lengths follow ShareGPT's long-tailed shape (lognormal prompt and reply
# lengths; vLLM's ShareGPT runs average ~215 prompt and ~200 output tokens), with a few
# single-turn, too-short and too-long conversations so the filters have something to
# drop. Seeded: the same seed writes the same bytes.
SAMPLE_TOKENS_PER_WORD = 1.3  # English text under a Llama-style BPE
PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA = 125, 1.0
REPLY_MEDIAN_TOKENS, REPLY_SIGMA = 140, 0.85
SAMPLE_MAX_TOKENS = 1600
_SAMPLE_WORDS = (
    "the a an this that these each every some many few system model server request "
    "response token stream batch queue cache memory latency throughput user client "
    "python code function value list table file data error result test step window "
    "kernel layer thread process cluster node replica service network packet time "
    "write read explain describe compare build run check measure improve reduce "
    "quickly simply carefully often usually always never again together instead "
    "is are was were can should would will must may might does do has have "
    "good fast slow large small simple complex new old first last next other same "
    "and or but because so if when while although then also however therefore "
    "in on at for with from into over under between through about after before"
).split()
_OPENERS = ("Can you", "Please", "How do I", "Why does", "What is", "Write", "Explain",
            "I need to", "Help me", "Could you")
_CODE = ("```python\ndef step(batch):\n    for seq in batch:\n        seq.append(sample(seq))\n"
         "    return batch\n```")


def _lognormal_tokens(rng: random.Random, median: int, sigma: float) -> int:
    return max(1, min(SAMPLE_MAX_TOKENS, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def _synthetic_text(rng: random.Random, num_tokens: int, is_prompt: bool) -> str:
    if num_tokens < 4:
        return rng.choice(("hi", "hello", "thanks", "ok", "continue"))
    num_words = max(1, int(round(num_tokens / SAMPLE_TOKENS_PER_WORD)))
    parts = [f"{rng.choice(_OPENERS)} {rng.choice(_SAMPLE_WORDS)}?"] if is_prompt else []
    remaining = num_words - (2 if is_prompt else 0)
    while remaining > 0:
        n = min(remaining, rng.randint(6, 22))
        words = [rng.choice(_SAMPLE_WORDS) for _ in range(n)]
        parts.append(" ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!")))
        remaining -= n
    if not is_prompt and num_words > 120 and rng.random() < 0.2:
        parts.insert(len(parts) // 2, _CODE)
    return " ".join(parts)


def _synthetic_conversation(rng: random.Random, index: int) -> dict:
    kind = rng.random()
    if kind < 0.03:  # greetings: the filter drops prompts under 4 tokens
        prompt_tokens = 2
    elif kind < 0.05:  # pasted documents: the filter drops prompts over 1024 tokens
        prompt_tokens = rng.randint(1100, 1500)
    else:
        prompt_tokens = _lognormal_tokens(rng, PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA)
    turns = [("human", _synthetic_text(rng, prompt_tokens, True))]
    if rng.random() > 0.04:  # some conversations never got an answer
        reply_tokens = _lognormal_tokens(rng, REPLY_MEDIAN_TOKENS, REPLY_SIGMA)
        turns.append(("gpt", _synthetic_text(rng, reply_tokens, False)))
        for _ in range(rng.choice((0, 0, 0, 1, 2))):  # follow-ups, for the multiturn replay
            turns.append(("human", _synthetic_text(rng, rng.randint(5, 40), True)))
            turns.append(("gpt", _synthetic_text(rng, rng.randint(20, 80), False)))
    return {"id": f"synthetic_{index:04d}",
            "conversations": [{"from": who, "value": text} for who, text in turns]}


def build_conversations(seed: int = 0, num_conversations: int = 200) -> list[dict]:
    rng = random.Random(seed)
    return [_synthetic_conversation(rng, i) for i in range(num_conversations)]


def render(conversations: list[dict]) -> str:
    return json.dumps(conversations, ensure_ascii=False, indent=1) + "\n"
