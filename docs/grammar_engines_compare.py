"""llguidance, xgrammar and outlines_core side by side on the preset tokenizer: the
figures behind the grammar engine's choice (docs/performance.md, "Choosing the
grammar engine").

The project installs llguidance only; put the other two beside it, outside the
project's venv, and run from the repository root:

    .venv/bin/pip install --target /tmp/gram_site --no-deps xgrammar==0.2.9 \
        outlines_core==0.2.14 apache-tvm-ffi
    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 PYTHONPATH=/tmp/gram_site \
        .venv/bin/python docs/grammar_engines_compare.py --rounds 5 --replays 10

One thread; engines interleaved round by round; medians over rounds.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

torch.set_num_threads(1)

from tokenizers import Tokenizer  # noqa: E402

from tests.structured_output_schemas import SCHEMAS  # noqa: E402
from loadtests.engine.structured_outputs import SCHEMA as BENCH_SCHEMA  # noqa: E402

ASSETS = os.path.join(REPO, "replicas", "assets")
TOK_JSON = f"{ASSETS}/tokenizer.json"
EOS = json.load(open(f"{ASSETS}/generation_config.json"))["eos_token_id"]  # [3, 1]
ALL_SCHEMAS = dict(SCHEMAS, bench=BENCH_SCHEMA)

# Valid instance of the benchmark schema (compact JSON, as the engine asks for).
BENCH_DOC = json.dumps({"items": [{"id": i * 1237 % 10000, "tag": ["alpha", "beta", "gamma"][i % 3],
                                   "ok": i % 2 == 0} for i in range(8)]}, separators=(",", ":"))

# Coverage probes: one valid document, then invalid ones, each breaking one keyword.
PROBES = {
    "nested": ('{"user":{"name":"ann","age":30},"score":-7}', {
        "nested required": '{"user":{"name":"ann"},"score":-7}',
        "maxLength": '{"user":{"name":"abcdefghijk","age":30},"score":-7}',
        "maximum": '{"user":{"name":"ann","age":300},"score":-7}',
        "minimum": '{"user":{"name":"ann","age":30},"score":-51}',
        "additionalProperties": '{"user":{"name":"ann","age":30,"x":1},"score":-7}',
    }),
    "array": ('[3,-5,99]', {
        "minItems": '[]',
        "maxItems": '[1,2,3,4,5]',
        "items.maximum": '[100]',
        "items.minimum": '[-6]',
    }),
    "enum": ('{"color":"green","size":"M","ok":true}', {
        "enum": '{"color":"pink","size":"M"}',
        "enum (typed)": '{"color":"red","size":"XL"}',
        "required": '{"color":"red"}',
    }),
    "pattern": ('{"id":"AB-123","email":"bob@mail.com"}', {
        "pattern": '{"id":"AB-12","email":"bob@mail.com"}',
        "pattern (alternation)": '{"id":"AB-123","email":"bob@mail.net"}',
    }),
    "array_of_objects": ('{"items":[{"k":"a","v":3},{"k":"b","v":0}]}', {
        "maxItems": '{"items":[{"k":"a","v":1},{"k":"a","v":1},{"k":"a","v":1},{"k":"a","v":1}]}',
        "items.enum": '{"items":[{"k":"c","v":3}]}',
        "items.required": '{"items":[{"k":"a"}]}',
        "items.maximum": '{"items":[{"k":"a","v":10}]}',
    }),
    "bench": (BENCH_DOC, {
        "minItems": '{"items":[{"id":1,"tag":"beta","ok":true}]}',
        "maxItems": json.dumps({"items": [{"id": 1, "tag": "beta", "ok": True}] * 11},
                               separators=(",", ":")),
        "items.maximum": BENCH_DOC.replace('"id":0', '"id":10000', 1),
    }),
}

REGEX = r"[A-Z]{2}-[0-9]{3}"
LARK = 'start: "yes" | "no"'


def bytes_of_tokens(tok: Tokenizer, vocab_size: int):
    """token id -> bytes, byte-level BPE (GPT-2 byte-to-unicode map); None for special tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out = [None] * vocab_size
    for s, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and s not in specials and all(ch in u2b for ch in s):
            out[i] = bytes(u2b[ch] for ch in s)
    return out


# --------------------------------------------------------------------------- engines
class LLG:
    name = "llguidance"

    def __init__(self, vocab_size):
        import llguidance as llg
        import llguidance.torch as llt
        from importlib.metadata import version
        self.llg, self.llt = llg, llt
        self.version = version("llguidance")
        self.tok = llg.LLTokenizer(open(TOK_JSON).read(), n_vocab=vocab_size, eos_token=EOS)
        self.bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def _matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile_json(self, schema):
        return self._matcher(self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))

    def compile_regex(self, rx):
        return self._matcher(self.llg.LLMatcher.grammar_from_regex(rx))

    def compile_lark(self, src):
        return self._matcher(self.llg.LLMatcher.grammar_from_lark(src))

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def mask(self, m):
        self.llt.fill_next_token_bitmask(m, self.bitmask, 0)

    def advance(self, m, t):
        return m.consume_token(t)

    def accepts(self, compiled, ids):
        m = compiled.deep_copy()
        for t in ids:
            if not m.consume_token(t) or m.is_error():
                return False
        return m.consume_token(EOS[0]) and not m.is_error()


class XGR:
    name = "xgrammar"

    def __init__(self, vocab_size):
        import transformers
        import xgrammar as xg
        from importlib.metadata import version
        self.xg = xg
        self.version = version("xgrammar")
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=TOK_JSON)
        info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=EOS)
        self.compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xg.allocate_token_bitmask(1, vocab_size)

    def compile_json(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=True)

    def compile_regex(self, rx):
        return self.compiler.compile_regex(rx)

    def compile_lark(self, src):
        # xgrammar takes GBNF/EBNF, not Lark; the same grammar in its EBNF dialect
        return self.compiler.compile_grammar('root ::= "yes" | "no"')

    def new_matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bitmask, 0)

    def advance(self, m, t):
        return m.accept_token(t)

    def accepts(self, compiled, ids):
        m = self.xg.GrammarMatcher(compiled)
        for t in ids:
            if not m.accept_token(t):
                return False
        return m.accept_token(EOS[0]) and m.is_terminated()


class OUT:
    name = "outlines_core"

    def __init__(self, vocab_size, token_bytes):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
        from importlib.metadata import version
        self.oc, self.build = oc, build_regex_from_schema
        self.version = version("outlines_core")
        vmap = {}
        for i, b in enumerate(token_bytes):
            if b is not None and i not in EOS:
                vmap.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(EOS[0], vmap)
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def compile_json(self, schema):
        # NOTE: whitespace_pattern "" = compact JSON, as the other two are asked for
        return self.oc.Index(self.build(json.dumps(schema), whitespace_pattern=""), self.vocab)

    def compile_regex(self, rx):
        return self.oc.Index(rx, self.vocab)

    def compile_lark(self, src):
        raise NotImplementedError("outlines_core takes regex and JSON schema only")

    def new_matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, g):
        g.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), 4)

    def advance(self, g, t):
        if t in EOS and g.is_finished():
            return True  # NOTE: a final Guide lists EOS in its mask but has no transition on it
        return g.advance(t, return_tokens=False)

    def accepts(self, compiled, ids):
        g = self.oc.Guide(compiled)
        try:
            for t in ids:
                g.advance(t, return_tokens=False)
        except Exception:  # noqa: BLE001 - a forbidden token
            return False
        return g.is_finished() or EOS[0] in g.get_tokens()


# --------------------------------------------------------------------------- measurements
def timed(fn, *a):
    t0 = time.perf_counter()
    r = fn(*a)
    return r, time.perf_counter() - t0


def replay(eng, compiled, ids):
    """(mask us/token, advance us/token) over one replay of ids, then EOS."""
    m = eng.new_matcher(compiled)
    mask_s = adv_s = 0.0
    seq = list(ids) + [EOS[0]]
    for t in seq:
        t0 = time.perf_counter()
        eng.mask(m)
        t1 = time.perf_counter()
        ok = eng.advance(m, t)
        t2 = time.perf_counter()
        if ok is False:
            raise RuntimeError(f"{eng.name} rejected token {t}")
        mask_s += t1 - t0
        adv_s += t2 - t1
    return mask_s / len(seq) * 1e6, adv_s / len(seq) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10, help="replays per engine per round")
    args = ap.parse_args()
    tok = Tokenizer.from_file(TOK_JSON)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    bench_ids = enc(BENCH_DOC)
    print(f"vocab {vocab_size}, eos {EOS}, benchmark document {len(bench_ids)} tokens "
          f"({len(BENCH_DOC)} bytes), torch threads {torch.get_num_threads()}")
    token_bytes = bytes_of_tokens(tok, vocab_size)

    engines = []
    for make in (lambda: LLG(vocab_size), lambda: XGR(vocab_size),
                 lambda: OUT(vocab_size, token_bytes)):
        e, dt = timed(make)
        print(f"{e.name} {e.version}: tokenizer setup {dt * 1e3:.0f} ms")
        engines.append(e)

    # coverage (once; deterministic)
    cov = {}
    for e in engines:
        compiled_n = enforced_n = 0
        gaps = []
        for name, schema in ALL_SCHEMAS.items():
            try:
                c = e.compile_json(schema)
            except Exception as ex:  # noqa: BLE001
                gaps.append(f"{name}: does not compile ({str(ex)[:80]})")
                continue
            compiled_n += 1
            valid, invalids = PROBES[name]
            ok = e.accepts(c, enc(valid))
            if not ok:
                gaps.append(f"{name}: rejects a valid document")
            bad = [k for k, doc in invalids.items() if e.accepts(c, enc(doc))]
            gaps += [f"{name}: ignores {k}" for k in bad]
            enforced_n += ok and not bad
        try:
            c = e.compile_regex(REGEX)
            regex = e.accepts(c, enc("AB-123")) and not e.accepts(c, enc("AB-12"))
        except Exception:  # noqa: BLE001
            regex = False
        try:
            c = e.compile_lark(LARK)
            gram = e.accepts(c, enc("yes")) and not e.accepts(c, enc("maybe"))
        except Exception:  # noqa: BLE001
            gram = False
        cov[e.name] = (compiled_n, enforced_n, gaps, regex, gram)

    compile_ms = {e.name: {n: [] for n in ALL_SCHEMAS} for e in engines}
    mask_us = {e.name: [] for e in engines}
    adv_us = {e.name: [] for e in engines}
    warm_us = {e.name: [] for e in engines}
    for r in range(args.rounds):
        order = engines[r % 3:] + engines[:r % 3]
        for e in order:
            for name, schema in ALL_SCHEMAS.items():
                try:
                    c, dt = timed(e.compile_json, schema)
                    compile_ms[e.name][name].append(dt * 1e3)
                except Exception:  # noqa: BLE001
                    pass
            # NOTE: as served, each request compiles its own matcher: a fresh compile per
            # replay ("cold"); then a second replay on the same compiled grammar ("warm").
            cold, warm = [], []
            for _ in range(args.replays):
                c = e.compile_json(BENCH_SCHEMA)
                cold.append(replay(e, c, bench_ids))
                warm.append(replay(e, c, bench_ids))
            mask_us[e.name].append(statistics.mean(x[0] for x in cold))
            adv_us[e.name].append(statistics.mean(x[1] for x in cold))
            warm_us[e.name].append(statistics.mean(x[0] for x in warm))
        print(f"round {r + 1}: " + ", ".join(
            f"{e.name} mask {mask_us[e.name][-1]:.1f} adv {adv_us[e.name][-1]:.1f}" for e in engines),
            flush=True)

    med = statistics.median
    N = len(ALL_SCHEMAS)
    print("\ncompile ms, median per schema:")
    for e in engines:
        print(f"  {e.name:14s} " + "  ".join(
            f"{n}={med(v):.2f}" if v else f"{n}=-" for n, v in compile_ms[e.name].items()))
    print(f"\n| engine | version | compile ms (median over schemas) | bench compile ms | "
          f"mask us/token | warm mask us/token | advance us/token | schemas compiled / enforced of {N} | regex | grammar |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in engines:
        per = [med(v) for v in compile_ms[e.name].values() if v]
        cn, en, gaps, rx, gr = cov[e.name]
        bench = compile_ms[e.name]["bench"]
        print(f"| {e.name} | {e.version} | {med(per):.2f} | {med(bench):.2f} | "
              f"{med(mask_us[e.name]):.1f} | {med(warm_us[e.name]):.1f} | {med(adv_us[e.name]):.1f} | {cn} / {en} | "
              f"{'yes' if rx else 'no'} | {'yes' if gr else 'no'} |")
    print("\ngaps:")
    for e in engines:
        print(f"  {e.name}: " + ("; ".join(cov[e.name][2]) or "none"))
    print("\nper-round mask us:", {k: [round(x, 1) for x in v] for k, v in mask_us.items()})
    print("per-round warm mask us:", {k: [round(x, 1) for x in v] for k, v in warm_us.items()})
    print("per-round advance us:", {k: [round(x, 1) for x in v] for k, v in adv_us.items()})


if __name__ == "__main__":
    main()
