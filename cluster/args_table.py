"""The config table of cluster/README.md, generated from `AppArgs`: every key of a
Serve config's `args:`, its default and its description, so that no default is
written twice by hand.

`python -m cluster.args_table` rewrites the table between the README's markers;
`--check` exits 1 when the table is stale (tests/cluster/test_args_table.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

README = Path(__file__).with_name("README.md")
BEGIN = "<!-- args-table: generated from AppArgs by `python -m cluster.args_table` -->"
END = "<!-- args-table: end -->"


def _show(value) -> str:
    """A default as a Serve config's YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def table() -> str:
    """The markdown table, one row per `AppArgs` field, in declaration order."""
    from cluster.app import AppArgs

    lines = ["| key | default | meaning |", "|---|---|---|"]
    for name, field in AppArgs.model_fields.items():
        meaning = field.description or ""
        if "|" in meaning or "\n" in meaning:
            raise ValueError(f"AppArgs.{name}: a description must be one line without '|'")
        lines.append(f"| `{name}` | `{_show(field.default)}` | {meaning} |")
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (the README) with the table between the markers regenerated."""
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"{README} needs the markers {BEGIN!r} and {END!r}") from None
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.args_table", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    ns = p.parse_args(argv)
    text = README.read_text()
    new = with_table(text)
    if ns.check:
        if new != text:
            print(f"{README}: the config table is stale; run python -m cluster.args_table",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
