"""Every `python -m loadtests.*` command the docs show names one of the tools and
parses with that tool's own parser (nothing runs): a renamed tool or flag fails here."""
import re
import shlex
from pathlib import Path

import pytest

from loadtests import bench, bench_engine, fake_server, gpu_check, soak
from loadtests.serving import noisy_neighbours, serving_matrix, serving_run

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "cluster/README.md", "RELIABILITY.md", "loadtests/README.md",
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
_COMMAND = re.compile(r"python\s+-m\s+(loadtests\.\w+)(.*)")

def _parse_bench(argv: list[str]):
    if argv[:1] == ["sharegpt-sample"]:
        return bench.make_sample_parser().parse_args(argv[1:])
    if argv[:1] == ["noisy-neighbours"]:
        return noisy_neighbours.make_parser().parse_args(argv[1:])
    if argv[:1] and argv[0] in bench.MATRIX_MODES:
        return serving_matrix.make_preset_parser(argv[0]).parse_args(argv[1:])
    return serving_run.make_parser().parse_args(argv)


PARSERS = {"loadtests.bench": _parse_bench, "loadtests.bench_engine": bench_engine.make_parser().parse_args,
           "loadtests.soak": soak.parse_args, "loadtests.fake_server": fake_server.parse_args,
           "loadtests.gpu_check": gpu_check.make_parser().parse_args}


def _code(doc: str) -> list[tuple[int, str]]:
    """(line, text) of each fenced block line (`\\` continuations joined) and of each
    inline code span (which may wrap lines) of `doc`; a span followed by `at revision
    REV` names a command of that revision (a tool since removed), not of this one."""
    fenced, prose, in_fence, pending = [], [], False, None
    for number, line in enumerate((REPO / doc).read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif in_fence and pending is not None:
            pending = (pending[0], pending[1] + " " + line.rstrip().rstrip("\\"))
            if not line.rstrip().endswith("\\"):
                fenced.append(pending)
                pending = None
        elif in_fence and line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
        elif in_fence:
            fenced.append((number, line))
        else:
            prose.append((number, line))
    text = "\n".join(line for _, line in prose)
    spans = [(prose[text.count("\n", 0, m.start())][0], m.group(1).replace("\n", " "))
             for m in re.finditer(r"`([^`]+)`", text)
             if not re.match(r"\s+at\s+revision\s+[0-9a-f]{7,40}\b", text[m.end():])]
    return fenced + spans


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of each command; `[...]` around optional flags dropped,
    `a|b` alternatives as the first argument give one command each."""
    out = []
    for doc in DOCS:
        for number, code in _code(doc):
            for m in _COMMAND.finditer(code):
                words = shlex.split(m.group(2).replace("[", " ").replace("]", " "), comments=True)
                words = words[:words.index("&")] if "&" in words else words
                firsts = words[0].replace("\\", "").split("|") if words and "|" in words[0] else [None]
                for first in firsts:
                    argv = [first, *words[1:]] if first else words
                    out.append((f"{doc}:{number}", m.group(1), argv))
    return out


COMMANDS = documented_commands()


def test_the_docs_show_every_tool():
    assert {module for _, module, _ in COMMANDS} == set(PARSERS)
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("where, module, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses(where, module, argv):
    assert module in PARSERS, f"{where}: no tool {module}"
    try:
        PARSERS[module](argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: python -m {module} {shlex.join(argv)} does not parse ({exc})")
