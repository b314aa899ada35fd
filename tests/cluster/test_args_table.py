"""The config keys' defaults are written once, in `AppArgs`: cluster/README.md's
table is generated from it (cluster/args_table.py), and the Serve configs in
configs/ set only keys whose value differs from the default. No Ray is started."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.args_table import BEGIN, END, README, main, table, with_table

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVE_CONFIGS = sorted(p.name for p in CONFIGS.glob("serve*.yaml"))


def test_readme_table_is_the_generated_one():
    text = README.read_text()
    assert with_table(text) == text, "the config table is stale: run python -m cluster.args_table"
    assert main(["--check"]) == 0


def test_every_key_has_a_row_with_its_default_and_a_meaning():
    from cluster.app import AppArgs

    rows = table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(AppArgs.model_fields)
    for name, field in AppArgs.model_fields.items():
        assert field.description, f"AppArgs.{name} needs a description (its row's meaning)"


def test_a_changed_default_makes_the_table_stale(monkeypatch):
    from cluster.app import AppArgs

    text = README.read_text()
    monkeypatch.setattr(AppArgs.model_fields["stall_timeout_s"], "default", 61.0)
    assert with_table(text) != text and "| `stall_timeout_s` | `61` |" in with_table(text)


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="markers"):
        with_table("no table here\n")
    assert with_table(f"a\n{BEGIN}\nold\n{END}\nb\n").startswith(f"a\n{BEGIN}\n| key |")


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_configs_set_only_what_differs_from_the_defaults(name):
    from cluster.app import AppArgs

    (app,) = yaml.safe_load((CONFIGS / name).read_text())["applications"]
    same = [key for key, value in app["args"].items()
            if value == AppArgs.model_fields[key].default]
    assert same == [], f"{name} restates AppArgs' defaults: {same}"
