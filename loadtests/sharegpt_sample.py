"""Write loadtests/data/sharegpt_sample.json: synthetic ShareGPT-format conversations.

No downloads. Lengths follow ShareGPT's long-tailed shape (lognormal prompt and
reply lengths; vLLM's ShareGPT runs average ~215 prompt and ~200 output tokens),
with a few single-turn, too-short and too-long conversations so the loader's
filters have something to drop. Seeded: the same seed writes the same bytes.

    python -m loadtests.bench sharegpt-sample [--seed 0] [--num-conversations 200]
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

OUTPUT_PATH = Path(__file__).parent / "data" / "sharegpt_sample.json"
TOKENS_PER_WORD = 1.3  # English text under a Llama-style BPE
PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA = 125, 1.0
REPLY_MEDIAN_TOKENS, REPLY_SIGMA = 140, 0.85
MAX_TOKENS = 1600

_WORDS = (
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
    return max(1, min(MAX_TOKENS, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def _sentence(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))


def _text(rng: random.Random, num_tokens: int, is_prompt: bool) -> str:
    if num_tokens < 4:
        return rng.choice(("hi", "hello", "thanks", "ok", "continue"))
    num_words = max(1, int(round(num_tokens / TOKENS_PER_WORD)))
    parts = [f"{rng.choice(_OPENERS)} {rng.choice(_WORDS)}?"] if is_prompt else []
    remaining = num_words - (2 if is_prompt else 0)
    while remaining > 0:
        n = min(remaining, rng.randint(6, 22))
        parts.append(_sentence(rng, n))
        remaining -= n
    if not is_prompt and num_words > 120 and rng.random() < 0.2:
        parts.insert(len(parts) // 2, _CODE)
    return " ".join(parts)


def _conversation(rng: random.Random, index: int) -> dict:
    kind = rng.random()
    if kind < 0.03:  # greetings: the filter drops prompts under 4 tokens
        prompt_tokens = 2
    elif kind < 0.05:  # pasted documents: the filter drops prompts over 1024 tokens
        prompt_tokens = rng.randint(1100, 1500)
    else:
        prompt_tokens = _lognormal_tokens(rng, PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA)
    turns = [("human", _text(rng, prompt_tokens, True))]
    if rng.random() > 0.04:  # some conversations never got an answer
        turns.append(("gpt", _text(rng, _lognormal_tokens(rng, REPLY_MEDIAN_TOKENS, REPLY_SIGMA), False)))
        for _ in range(rng.choice((0, 0, 0, 1, 2))):  # follow-ups the loader ignores
            turns.append(("human", _text(rng, rng.randint(5, 40), True)))
            turns.append(("gpt", _text(rng, rng.randint(20, 80), False)))
    return {"id": f"synthetic_{index:04d}",
            "conversations": [{"from": who, "value": text} for who, text in turns]}


def build_conversations(seed: int = 0, num_conversations: int = 200) -> list[dict]:
    rng = random.Random(seed)
    return [_conversation(rng, i) for i in range(num_conversations)]


def render(conversations: list[dict]) -> str:
    return json.dumps(conversations, ensure_ascii=False, indent=1) + "\n"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench sharegpt-sample",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-conversations", type=int, default=200)
    parser.add_argument("--output", type=Path, default=OUTPUT_PATH)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    text = render(build_conversations(args.seed, args.num_conversations))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.num_conversations} conversations, {len(text.encode())} bytes, to {args.output}")

