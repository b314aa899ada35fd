"""The cluster YAMLs' node commands, dry-run the way Ray's cluster launcher runs
them, without a cloud or a host; and the token auth they set up.

On each node `ray up` first copies `file_mounts`, then runs every command over SSH
as `bash --login -c -i 'source ~/.bashrc; export ... && (<command>)'` (Ray's own
`_with_interactive`), the worker ones prefixed by `export RAY_HEAD_IP=<ip>;`
(Ray's `with_head_node_ip`), `ray start` on the head with the usage-stats variable
(Ray's `_with_environment_variables`); `ray exec` runs its command the same way.
Here a temporary directory stands for the node's home, the token mount is copied
in by hand, and the programs that would change a machine (`ray`, `serve`,
`python3`, `pip`, `sudo`, `aws`) are stubs that record their arguments, the
`RAY_AUTH_MODE` they see and the token in place; the node's PATH holds nothing
else but `grep`, `cat` and `basename`. The shells, the ~/.bashrc they source,
`ulimit`, `test` and the rest run for real, in Ray's wrapping (including what
Ray's defaults add, such as the AWS head node's boto3 install), and every
`ray start` line is parsed by Ray's own CLI.
"""
from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from docs_support import REPO, all_snippets, shell_commands

CLUSTER_CONFIGS = ["cluster.yaml", "cluster-local.yaml"]
# Programs that would change a machine: stubs. The node's PATH holds nothing else
# but REAL: a command that needs anything more fails here instead of running.
STUBBED = ("ray", "serve", "python3", "python", "pip", "pip3", "sudo", "aws")
REAL = ("grep", "cat", "basename")
HEAD_IP = "10.0.0.10"
EXPORT_LINE = "export RAY_AUTH_MODE=token"
# A fresh Ubuntu ~/.bashrc begins like this: nothing for non-interactive shells.
BASHRC = """case $- in
    *i*) ;;
      *) return;;
esac
export PATH="{bin}"
"""
STUB = r"""#!/bin/bash
{
  printf '%s' "$(basename "$0")"
  printf '\x1f%s' "${RAY_AUTH_MODE-<unset>}" \
    "$([ -s "$HOME/.ray/auth_token" ] && cat "$HOME/.ray/auth_token" || echo '<no token>')" "$@"
  printf '\n'
} >> "$STUB_LOG"
"""


def _prepared(name: str) -> dict:
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(copy.deepcopy(yaml.safe_load((REPO / "configs" / name).read_text())))


class Node:
    """A stand-in for one node: its home, the stubs, what the stubs saw."""

    def __init__(self, root: Path, config: dict, token: str):
        self.home = root / "node"
        self.home.mkdir()
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for prog in STUBBED:
            (bin_dir / prog).write_text(STUB)
            (bin_dir / prog).chmod(0o755)
        for prog in REAL:
            (bin_dir / prog).symlink_to(shutil.which(prog))
        (self.home / ".bashrc").write_text(BASHRC.format(bin=bin_dir))
        self.log = root / "calls.log"
        self.user_home = f"/home/{config['auth']['ssh_user']}"
        # file_mounts, as `ray up` copies them before any command; `~` is the home
        # of the machine that runs `ray up`.
        laptop = root / "laptop"
        (laptop / ".ray").mkdir(parents=True)
        (laptop / ".ray" / "auth_token").write_text(token)
        for remote, local in config["file_mounts"].items():
            assert remote.startswith(self.user_home + "/"), remote
            dest = self.home / remote[len(self.user_home) + 1:]
            if local == ".":
                dest.symlink_to(REPO)  # the repository, synced
            elif local.startswith("~/"):
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(laptop / local[2:], dest)

    def run(self, cmd: str, env_vars: dict | None = None, head_ip: str | None = None) -> None:
        """One command as Ray's SSH command runner runs it on a node."""
        from ray.autoscaler._private.command_runner import (
            _with_environment_variables, _with_interactive,
        )
        from ray.autoscaler._private.util import with_head_node_ip

        if head_ip:
            cmd = with_head_node_ip([cmd], head_ip)[0]
        if env_vars:
            cmd = _with_environment_variables(cmd, env_vars)
        # sshd hands the joined words to the user's shell: that is what unquotes them
        remote = " ".join(_with_interactive(cmd))
        env = {"HOME": str(self.home), "PATH": "/usr/local/bin:/usr/bin:/bin",
               "USER": "ubuntu", "LANG": "C.UTF-8", "STUB_LOG": str(self.log)}
        proc = subprocess.run(["bash", "-c", remote], cwd=self.home, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{cmd!r} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"

    def calls(self) -> list[tuple[str, str, str, list[str]]]:
        """(program, RAY_AUTH_MODE, token, args) per stub call."""
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            prog, mode, token, *args = line.split("\x1f")
            out.append((prog, mode, token, args))
        return out


def _bring_up(node: Node, config: dict, role: str) -> None:
    """One node's part of `ray up`: initialization, setup, start commands."""
    head_ip = HEAD_IP if role == "worker" else None
    for cmd in config["initialization_commands"]:
        node.run(cmd, head_ip=head_ip)
    for cmd in config[f"{role}_setup_commands"]:
        node.run(cmd, head_ip=head_ip)
    env_vars = {"RAY_USAGE_STATS_ENABLED": 0} if role == "head" else None
    for cmd in config[f"{role}_start_ray_commands"]:
        node.run(cmd, env_vars=env_vars, head_ip=head_ip)


@pytest.mark.parametrize("role", ["head", "worker"])
@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_every_ray_command_on_a_node_runs_with_the_token(name, role, tmp_path):
    from ray.scripts.scripts import start

    config = _prepared(name)
    node = Node(tmp_path, config, token="the-cluster-token")
    _bring_up(node, config, role)
    _bring_up(node, config, role)  # `ray up` again (or a restarted node): same result

    calls = node.calls()
    ray_calls = [c for c in calls if c[0] == "ray"]
    starts = [args for prog, _, _, args in ray_calls if args[:1] == ["start"]]
    assert len(starts) == 2 and any(args[:1] == ["stop"] for _, _, _, args in ray_calls)
    for prog, mode, token, args in ray_calls:
        assert (mode, token) == ("token", "the-cluster-token"), (prog, args)
    for args in starts:
        start.make_context("ray start", list(args[1:]))  # Ray's own CLI parses every flag
        if role == "head":
            assert "--head" in args and "--num-gpus=0" in args
        else:
            assert f"--address={HEAD_IP}:6379" in args
    # the repository is installed from where file_mounts put it
    installs = [args for prog, _, _, args in calls if prog == "python3" and "-e" in args]
    assert installs, calls
    for args in installs:
        target = args[args.index("-e") + 1]
        path, extras = target.split("[", 1)
        assert config["file_mounts"].get(path) == ".", target
        with open(REPO / "pyproject.toml", "rb") as f:
            optional = tomllib.load(f)["project"]["optional-dependencies"]
        assert set(extras.rstrip("]").split(",")) <= set(optional), target
    bashrc = (node.home / ".bashrc").read_text().splitlines()
    assert bashrc.count(EXPORT_LINE) == 1, bashrc


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_serve_deploy_through_ray_exec_sends_the_token(name, tmp_path):
    """The docs' `ray exec <yaml> '<command>'` runs on the head node with the token."""
    config = _prepared(name)
    node = Node(tmp_path, config, token="the-cluster-token")
    _bring_up(node, config, "head")
    execs = [shlex.split(c) for s in all_snippets()["cluster"] for c in shell_commands(s.text)
             if c.startswith("ray exec ")]
    assert execs, "the docs give no `ray exec` for the cluster"
    for words in execs:
        assert (REPO / words[2]).is_file(), words
        remote = words[3]
        node.run(remote)
        (serve_call,) = [c for c in node.calls() if c[0] == "serve"][-1:]
        assert serve_call[1:3] == ("token", "the-cluster-token"), serve_call
        deployed = serve_call[3][-1]
        assert serve_call[3][0] == "deploy" and (node.home / deployed).is_file(), serve_call


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_token_is_mounted_from_the_users_home_not_the_repository(name):
    raw = yaml.safe_load((REPO / "configs" / name).read_text())
    user_home = f"/home/{raw['auth']['ssh_user']}"
    assert raw["file_mounts"][f"{user_home}/.ray/auth_token"] == "~/.ray/auth_token"
    text = (REPO / "configs" / name).read_text()
    assert "RAY_AUTH_TOKEN=" not in text and "RAY_AUTH_MODE=disabled" not in text
    assert any(EXPORT_LINE in cmd for cmd in raw["initialization_commands"])


def test_docs_make_the_token_before_ray_up():
    for snip in all_snippets()["cluster"]:
        cmds = shell_commands(snip.text)
        gen = next(i for i, c in enumerate(cmds) if "ray get-auth-token --generate" in c)
        up = next(i for i, c in enumerate(cmds) if c.startswith("ray up "))
        assert gen < up, snip.where
        assert (REPO / shlex.split(cmds[up])[2]).name in CLUSTER_CONFIGS, snip.where
