"""An engine replica with tensor_parallel_size 2 through Serve on a local Ray: its
ranks are Ray actors in a placement group of two bundles (the replica in the first),
it serves the greedy completions of one rank, a killed rank actor ends that
replica's streams with an error event and Serve brings the replica back (with a new
group), and deleting the app leaves no group or rank behind."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from cluster_support import serve_app, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

APP_ARGS = {"model": "tiny", "dtype": "float32", "tensor_parallel_size": 2,
            "engine_num_cpus": 1, "ingress_num_cpus": 0.5, "num_threads": 1,
            "max_num_seqs": 8, "num_kv_blocks": 256, "max_model_len": 512,
            "health_check_period_s": 1.0, "health_check_timeout_s": 5.0}
PROMPTS = ["The owl went to", "Once upon a time", "1, 2, 3,"]


def _rank_pids() -> list[int]:
    """The live rank actors' processes (rank 0 is the replica itself)."""
    import ray
    return [a["Pid"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "_RankActor" and a["State"] == "ALIVE"]


def _groups(state: str = "CREATED") -> list:
    import ray
    return [g for g in ray.util.placement_group_table().values() if g["state"] == state]


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS) as base:
        yield base
    assert wait_until(lambda: not _rank_pids() and not _groups(), 60), \
        (_rank_pids(), _groups())


def test_two_ranks_serve_the_greedy_completions_of_one(server):
    from replicas import Engine, EngineConfig, SamplingParams
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    tokenizer = Tokenizer.from_dir(resolve_tokenizer_dir("tiny"))
    with Engine(EngineConfig(model="tiny", dtype="float32", num_threads=1)) as engine:
        expected = [o.text for o in engine.generate(
            [tokenizer.encode(p) for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    got = [httpx.post(server + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]["text"] for p in PROMPTS]
    assert got == expected
    [group] = _groups()
    assert [b for b in group["bundles"].values()] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert len(_rank_pids()) == 1


def test_a_killed_rank_ends_its_replicas_streams_and_the_replica_comes_back(server):
    [rank_pid] = _rank_pids()
    old_group = _groups()[0]["placement_group_id"]
    events = []
    with httpx.stream("POST", server + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "A long story:", "max_tokens": 400,
            "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                os.kill(rank_pid, signal.SIGKILL)
    assert events[-1] != "data: [DONE]"
    assert "error" in json.loads(events[-1].removeprefix("data: ")), events[-1]

    def serves_again():
        r = httpx.post(server + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 4})
        return r.status_code == 200
    assert wait_until(serves_again, 120, interval_s=1.0)
    assert [g["placement_group_id"] for g in _groups()] != [old_group]
    assert len(_rank_pids()) == 1
