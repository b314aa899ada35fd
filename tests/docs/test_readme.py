"""The README's Quickstart and its list of request fields tell the truth.

Every command block of the Quickstart is run as written by tests/docs/
test_docs_commands.py (it carries a `docs-test` tag), except the one that needs a
checkpoint of the reader's own. The fields table names exactly the fields the
request models accept, so a field added to or refused by `cluster/api/openai_protocol.py`
shows up here as a failure until the README says so.
"""
from __future__ import annotations

import re

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from docs_support import REPO, read_snippets

README = (REPO / "README.md").read_text()
# Blocks a fresh clone cannot run: they name a checkpoint directory the reader has.
NEEDS_A_CHECKPOINT = ("--model /models/", "MODEL=/models/")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def test_quickstart_comes_first():
    assert re.findall(r"^## (.+)$", README, re.M)[0] == "Quickstart"


def test_every_quickstart_block_is_run_by_the_docs_tests():
    lines = README.splitlines()
    first = lines.index("## Quickstart")
    end = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("## "))
    tagged = {snippet.line for snippet in read_snippets("README.md")}  # 1-based fences
    untagged = []
    for i in range(first + 1, end):
        if not lines[i].startswith("```") or lines[i].strip() == "```":
            continue  # not an opening fence
        body = "\n".join(lines[i + 1:lines.index("```", i + 1)])
        if i + 1 not in tagged and not any(marker in body for marker in NEEDS_A_CHECKPOINT):
            untagged.append(body)
    assert not untagged, f"Quickstart blocks no test runs: {untagged}"


def test_quickstart_says_the_presets_have_random_weights():
    assert "random weights" in _section("Quickstart")


def _listed_fields() -> set[str]:
    table = _section("What the API accepts")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[2])}


def test_fields_table_names_every_accepted_field_and_nothing_else():
    accepted = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    listed = _listed_fields() - {"include_usage", "continuous_usage_stats", "system",
                                 "developer", "user", "assistant",
                                 # a tool's and a message's own fields
                                 "name", "description", "parameters", "strict", "tool_calls",
                                 "tool", "tool_call_id", "arguments", "index", "id", "type",
                                 "finish_reason"}
    # `user` is both a field and a role: it must be listed as a field.
    assert "user" in accepted
    assert listed | {"user"} == accepted, (
        f"accepted but not listed: {sorted(accepted - listed - {'user'})}; "
        f"listed but not accepted: {sorted(listed - accepted)}")


def test_fields_said_to_be_refused_are_not_accepted():
    refused = _section("What the API accepts").split("Refused with a 400:")[1]
    names = set(re.findall(r"`([a-z_]+)`", refused.split("Errors,")[0]))
    for name in names - {"n", "best_of", "echo", "suffix"}:
        assert name not in CompletionRequest.model_fields, name
        assert name not in ChatCompletionRequest.model_fields, name
