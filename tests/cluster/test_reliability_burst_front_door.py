"""A burst far past the bounds through the product's front door (the launcher:
HAProxy to the ingress replica), on a machine slowed by a busy loop on one core
(or by the suite's other lanes while they run):
the streams already running complete (never stalled as long as a queue timeout),
every request let in completes and gets
its first token within 2.5 s of its admission, the slowest too (the ingress's
`Server-Timing`). Both bounds are for the machine they were set on; on a slower one
they grow by the ratio of the same burst's intake without the engine, measured
before the burst, and after it too where a bound is missed: the slower of the two
counts. The rest get 429 + Retry-After without waiting for a slot, from the ingress's
own gate (cluster/api/pending_gate.py), before their body is read. A round whose
running streams did not live through the burst's sending (on a loaded machine the
burst can start late, or a stalled reader reads a stream in a clump) proves nothing
and runs again, up to BURST_ROUNDS.

Without the gate (`ingress_max_pending_requests: -1`) the same test fails: every
request of the burst is parsed, tokenized and routed on the event loop that
forwards the running streams' deltas, to be refused by an engine replica (0 of 756
refusals by the gate), and the admitted ones waited 3.9 s (median) for their first
token after admission, 4.2 s at most (with the gate: 0.5-1.2 s, 1.0-1.4 s at most
when run alone). The
burst comes from a process of its own (tests/burst_client.py), so that the client's
own work on 800 connections does not delay the reading of the running streams.

On the same server, first: non-streamed requests whose clients leave are aborted
behind HAProxy too (Serve starts it as `stepstream-haproxy`, splice() off: with
splicing some ran to their last token; RELIABILITY.md, promise 2)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loadtests.serving.client_wait import ClientWait
from loadtests.serving.local_server import LocalServer, free_port
from reliability_support import busy_core, stream_request

pytestmark = [pytest.mark.ray, pytest.mark.front_door, pytest.mark.slows_the_machine,
              pytest.mark.timeout(600)]

MODEL = "tiny"
MAX_NUM_SEQS = 4  # two running streams leave every replica slots free
QUEUE_TIMEOUT_S = 8.0
NUM_ENGINE_REPLICAS = 2
APP_ARGS = {"model": MODEL, "num_engine_replicas": NUM_ENGINE_REPLICAS, "engine_num_cpus": 0.5,
            "ingress_num_cpus": 0.5, "num_threads": 1, "max_num_seqs": MAX_NUM_SEQS,
            "num_kv_blocks": 512, "max_model_len": 2048, "num_scheduler_steps": 4,
            "queue_timeout_s": QUEUE_TIMEOUT_S}
BURST_FACTOR = 50  # requests per admission slot of the engines
# NOTE: a stall shorter than the queue timeout at the reference pace (below), growing
# with the machine's pace as the intake does. Gaps of 3-4.6 s were timed here at the
# burst's peak (9.4 s beside the suite's other lanes, at an intake 1.93x slower); the
# reader's own loop turned out to be stalled for nearly all of them (a 1.90 s gap
# held 1.87 s of it), so the bound now holds the server to its part of a gap.
RUNNING_GAP_BOUND_S = QUEUE_TIMEOUT_S
RAW_GAP_FACTOR = 2.0  # the gap as the reader timed it, its own stalls included
RUNNING_STREAMS = 2
# NOTE: as long as max_model_len lets them (tiny's context is 2,048): beside the
# suite's other lanes a stream of 1,900 tokens once ended before half the burst was sent.
RUNNING_TOKENS = 2000
BURST_TOKENS = 16
MIN_SENDING_COVERED = 1 / 3  # of the burst's sending, by each running stream, or:
MIN_LIFE_IN_SENDING = 1 / 2  # of each running stream's life, inside the sending
BURST_ROUNDS = 3  # rounds whose running streams did not live through the burst void
RUNNING_FIRST_TOKEN_TIMEOUT_S = 60.0  # bounds a wait, times nothing
INTAKE_FACTOR = 3.0
PROMPT_REPEATS = 16  # about 120 tokens a prompt: a burst of real prompts
# NOTE: 2.5 s, not 2: beside the suite's other lanes the slowest admission reached
# 2.09 s at the reference pace once (4.57 s at an intake 2.19x slower) and passed
# alone; without the gate the median alone is 3.9 s, still far past 2.5.
ADMITTED_TTFT_BOUND_S = 2.5
# NOTE: the bound is for a machine on which the same burst answered without the
# engine takes at most this long at the median (the one the bound was set on: 10 s);
# on a slower one it grows by that ratio, as every wait here does (a CI machine ran
# every lane 2-3x slower). Without the gate the median was 3.9 s at 10 s of intake.
REFERENCE_INTAKE_S = 10.0
INGRESS_REFUSAL = "ingress_max_pending_requests"  # in the gate's 429 message


@pytest.fixture(scope="module")
def metrics_url():
    return f"http://127.0.0.1:{free_port()}/metrics"


@pytest.fixture(scope="module")
def server(tmp_path_factory, metrics_url):
    tmp = tmp_path_factory.mktemp("burst")
    config = tmp / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [
        {"name": "stepstream", "route_prefix": "/", "import_path": "cluster.app:build_app",
         "args": APP_ARGS}]}))
    metrics_port = metrics_url.split(":")[-1].split("/")[0]
    with LocalServer(["--config", str(config), "--num-cpus", "4", "--metrics-port", metrics_port],
                     model=MODEL, log_path=tmp / "server.log", stop_timeout_s=60) as srv:
        yield srv.base_url


ABANDONED = 4  # at once: with splicing, 1-2 of 4 ran to their end in every round of 3
ABANDON_AFTER_S = 1.0
ABORTED_WITHIN_S = 60.0  # bounds a wait for Ray's metrics (reported every 10 s)
LEAVE_ROUNDS = 3  # rounds the test's own stalls may void (see the test)


def _requests_by_status(metrics_url: str) -> dict[str, float]:
    """ray_stepstream_requests_total by status, from the launcher's Prometheus page."""
    counts: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_stepstream_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = counts.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def _leave_all(url: str, round_no: int) -> tuple[list[tuple], ClientWait]:
    """ABANDONED non-streamed requests, each left after ABANDON_AFTER_S: the ones
    answered first, as (k, status, sent at, answered at), and this loop's stalls."""
    own_wait = ClientWait().start()

    async def leave(k: int):
        body = {**_body(1500, f"Tell me a long story {round_no}.{k}"), "stream": False}
        async with httpx.AsyncClient(timeout=ABANDON_AFTER_S) as client:
            sent_at = time.monotonic()
            try:
                r = await client.post(url, json=body)
            except httpx.TimeoutException:
                return None  # left, as meant
            return k, r.status_code, sent_at, time.monotonic()

    answered = [a for a in await asyncio.gather(*(leave(k) for k in range(ABANDONED))) if a]
    own_wait.take()
    return answered, own_wait


def _settled(metrics_url: str, before: dict[str, float]) -> tuple[float, float]:
    """(499s, 200s) since `before`, once all ABANDONED are counted or ABORTED_WITHIN_S
    passed (Ray reports metrics every 10 s)."""
    deadline = time.monotonic() + ABORTED_WITHIN_S
    while True:
        now = _requests_by_status(metrics_url)
        gone = now.get("499", 0) - before.get("499", 0)
        answered = now.get("200", 0) - before.get("200", 0)
        if gone + answered >= ABANDONED or time.monotonic() > deadline:
            return gone, answered
        time.sleep(1.0)


def test_a_non_streamed_request_whose_client_leaves_is_aborted_behind_haproxy(server, metrics_url):
    """Each counts 499 (its client gone before its status), none 200 (run on to its
    last token after its client left).

    NOTE: leaving takes this test's own loop to run its 1 s timeout: beside the suite's
    other lanes it was once stalled past an answer's 7.5 s (a 200, read at once when
    the loop ran again). A round whose answers all came while the loop was stalled
    past its timeout proves nothing either way; it runs again, up to LEAVE_ROUNDS."""
    url = server + "/v1/completions"
    for round_no in range(1, LEAVE_ROUNDS + 1):
        before = _requests_by_status(metrics_url)
        answered, own_wait = asyncio.run(_leave_all(url, round_no))
        gone, counted_200 = _settled(metrics_url, before)
        # void only when every answer is one the client could not have left before: it
        # came after the timeout was due, the loop stalled for most of the time between
        voided = answered and all(
            status == 200 and got - sent > ABANDON_AFTER_S
            and own_wait.stalled_within(sent + ABANDON_AFTER_S, got)
            >= 0.5 * (got - sent - ABANDON_AFTER_S) for _, status, sent, got in answered)
        if not voided or round_no == LEAVE_ROUNDS:
            break
        print(f"round {round_no}: {len(answered)} answered while this test's loop was "
              f"stalled past its timeout; again")
    assert not answered, (f"answered before the client left (k, status, sent, answered; "
                          f"round {round_no}): {answered}")
    assert (gone, counted_200) == (ABANDONED, 0), (
        f"of {ABANDONED} abandoned requests {gone} were aborted, {counted_200} ran to their end")


def _body(max_tokens: int, prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _slowdown(intake_s: list[float]) -> float:
    """How much slower than the reference machine this intake ran (see
    REFERENCE_INTAKE_S); 1 at its pace or faster."""
    return max(1.0, _median(intake_s) / REFERENCE_INTAKE_S)


def _ttft_bound_s(intake_s: list[float]) -> float:
    """The admitted first-token bound at the pace of this intake."""
    return ADMITTED_TTFT_BOUND_S * _slowdown(intake_s)


def _gap_bound_s(intake_s: list[float]) -> float:
    """The running streams' longest-stall bound at the pace of this intake."""
    return RUNNING_GAP_BOUND_S * _slowdown(intake_s)


def _burst_command(url: str, num_requests: int, max_tokens: int, model: str,
                   start_at: float) -> list[str]:
    client = Path(__file__).resolve().parents[1] / "burst_client.py"
    return [sys.executable, str(client), url, str(num_requests), str(max_tokens), model,
            str(PROMPT_REPEATS), str(start_at)]


def _run_burst(url: str, num_requests: int, max_tokens: int, model: str = MODEL) -> dict:
    """A burst sent at once, from a process of its own (tests/burst_client.py)."""
    out = subprocess.run(_burst_command(url, num_requests, max_tokens, model, 0.0),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


class _ReadyBurst:
    """A burst client started ahead (its imports and connections pool take seconds on
    a busy machine) that sends when told."""

    def __init__(self, url: str, num_requests: int, max_tokens: int) -> None:
        self.proc = subprocess.Popen(_burst_command(url, num_requests, max_tokens, MODEL, -1),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read()[-3000:]

    def send(self) -> dict:
        told_at = time.monotonic()
        out, err = self.proc.communicate("go\n", timeout=300)
        assert self.proc.returncode == 0, err[-3000:]
        return {**json.loads(out), "told_at": told_at}


def _overlap_s(r, sent: dict) -> float:
    """How long running stream `r` streamed while the burst `sent` was being sent."""
    return min(r.event_times[-1], sent["last_sent"]) - sent["first_sent"]


def _covered(r, sent: dict) -> float:
    """The share of the burst's sending that running stream `r` streamed through."""
    return _overlap_s(r, sent) / max(sent["last_sent"] - sent["first_sent"], 1e-9)


def _lived_through(r, sent: dict) -> str | None:
    """Why running stream `r` did not live through the burst `sent`, or None.

    NOTE: each running stream must live through the burst: a third of its sending
    at least, or half its own life inside the sending. Beside the suite's other
    lanes sending 800 requests took up to 8.4 s on one machine, about a stream's
    life; on another (AVX2) the longest stream tiny's context allows ran 10 s
    alone while the sending took 20 s, and ended 0.1 s before its half; on one
    with AVX-512 streams of 8-9 s met a sending of 8.5 s alone (the intake
    without the engine: 0.3 s), and beside the lanes streams of 0.6-2.7 s (read
    in clumps by a stalled reader) met sendings that began 0.6-2.7 s after their
    first event: a round that did not overlap proves nothing, and runs again."""
    covered = _covered(r, sent)
    life_in_sending = _overlap_s(r, sent) / max(r.event_times[-1] - r.event_times[0], 1e-9)
    if r.event_times[0] < sent["first_sent"] and (
            covered >= MIN_SENDING_COVERED or life_in_sending >= MIN_LIFE_IN_SENDING):
        return None
    return (f"a running stream did not run through the burst ({covered:.0%} of its "
            f"sending, {life_in_sending:.0%} of its life): it streamed "
            f"{r.event_times[-1] - r.event_times[0]:.2f} s from "
            f"{sent['first_sent'] - r.event_times[0]:.2f} s before the sending, which took "
            f"{sent['last_sent'] - sent['first_sent']:.2f} s; the burst was told to send "
            f"{sent['first_sent'] - sent['told_at']:.2f} s before it")


def test_a_burst_of_50x_the_slots_on_a_slowed_machine_never_starves_admitted_streams(server):
    from cluster.app import AppArgs

    args = AppArgs.model_validate(APP_ARGS)
    slots = args.engine_max_admitted * NUM_ENGINE_REPLICAS
    num_requests = BURST_FACTOR * slots
    url = server + "/v1/completions"

    async def burst_round(client, round_no: int):
        """The running streams, then the burst: (running, sent, own_wait, waited)."""
        # NOTE: what this test's own loop (the running streams' reader) waited for a
        # CPU: a stall it measures may be partly its own (loadtests/serving/client_wait.py)
        own_wait = ClientWait().start()
        # NOTE: the burst's client starts first; once the running streams stream,
        # it is told to send
        burst = await asyncio.to_thread(_ReadyBurst, url, num_requests, BURST_TOKENS)
        streaming = [asyncio.Event() for _ in range(RUNNING_STREAMS)]
        running = [asyncio.ensure_future(stream_request(
            client, url, _body(RUNNING_TOKENS, f"Running {k} of round {round_no}"),
            first_event=streaming[k])) for k in range(RUNNING_STREAMS)]
        # the burst goes out as soon as every running stream streams: their whole
        # life is left to run through it
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)),
                               RUNNING_FIRST_TOKEN_TIMEOUT_S)
        burst = asyncio.ensure_future(asyncio.to_thread(burst.send))
        running, sent = await asyncio.gather(*running), await burst
        return running, sent, own_wait, own_wait.take()

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            # the same burst answered without the engine (404: an unknown model, or
            # 429 from the gate, which counts these too): the pace at which the
            # client and the front door take it in
            intake = await asyncio.to_thread(_run_burst, url, num_requests, 16, "none")
            for round_no in range(1, BURST_ROUNDS + 1):
                running, sent, own_wait, waited = await burst_round(client, round_no)
                missed = [why for why in (_lived_through(r, sent) for r in running
                                          if r.status == 200 and r.event_times) if why]
                # NOTE: only a round with nothing else wrong runs again: a stream that
                # failed, or a burst answer other than 200 or 429, fails the test below
                clean = (all(r.status == 200 and r.done and not r.error_events
                             for r in running)
                         and all(row[0] in (200, 429) for row in sent["rows"]))
                if not missed or not clean or round_no == BURST_ROUNDS:
                    break
                print(f"round {round_no}: {missed[0]}; again")
        return intake, running, sent, own_wait, waited, missed

    with busy_core():
        intake, running, sent, own_wait, waited, missed = asyncio.run(run())
    intake_sending_s = intake["last_sent"] - intake["first_sent"]
    intake, burst = intake["rows"], sent["rows"]
    assert {status for status, *_ in intake} <= {404, 429}
    for r in running:  # the streams already running complete at their pace
        assert r.status == 200 and r.done and not r.error_events, r.events[-2:]
    assert not missed, (f"{missed[0]} (in each of {BURST_ROUNDS} rounds; the intake's "
                        f"sending: {intake_sending_s:.2f} s)")
    gaps, server_gaps = [], []
    covered = [_covered(r, sent) for r in running]
    for r in running:
        gaps.append(max(b - a for a, b in zip(r.event_times, r.event_times[1:])))
        # NOTE: a gap is timed by this test's own loop, which shares the cores with the
        # busy loop and the server: alone here it once stalled 2.89 s, and the longest
        # gap was 2.88 s. The stall bound holds the server to its part of each gap: the
        # gap less the time the reader itself was stalled within it.
        server_gaps.append(max(own_wait.gaps_less_stalls(r.event_times)))
    server_gap_s = max(server_gaps)
    admitted = [row for row in burst if row[0] == 200]
    refused = [row for row in burst if row[0] == 429]
    other = [row for row in burst if row[0] not in (200, 429)]
    ttfts = [ttft for _, _, _, ttft, *_ in admitted]
    refusal_s = [ended for _, _, ended, *_ in refused]
    intake_s = [ended for _, _, ended, *_ in intake]
    by_gate = [row for row in refused if INGRESS_REFUSAL in row[-1]]
    print(f"\nburst of {num_requests} ({BURST_FACTOR}x {slots} slots, one core busy or the "
          f"suite's other lanes running): "
          f"{len(admitted)} admitted, {len(refused)} refused (429; {len(by_gate)} by the "
          f"ingress's gate), {len(other)} other; "
          f"first token after admission: median {_median(ttfts):.3f} s, slowest "
          f"{max(ttfts, default=0):.2f} s (after sending: median "
          f"{_median([first for _, first, *_ in admitted]):.2f} s); refusal after sending: "
          f"median {_median(refusal_s):.2f} s (the same burst without the engine: "
          f"{_median(intake_s):.2f} s); running streams' longest gap {max(gaps):.2f} s "
          f"({server_gap_s:.2f} s less the reader's own stalls), "
          f"through {min(covered):.0%} of the burst's sending at least (streams of "
          f"{[round(r.event_times[-1] - r.event_times[0], 2) for r in running]} s, "
          f"first events {[round(sent['first_sent'] - r.event_times[0], 2) for r in running]} s "
          f"before the sending, told {sent['first_sent'] - sent['told_at']:.2f} s before it, "
          f"sending {sent['last_sent'] - sent['first_sent']:.2f} s); this test's "
          f"reader waited for a CPU {waited['client_cpu_wait_share'] or 0:.1%} of the "
          f"time, its loop stalled up to {waited['client_longest_loop_stall_ms']:.0f} ms")
    assert not other, other[:5]
    assert all(complete for *_, complete, _ in admitted)
    assert len(admitted) >= MAX_NUM_SEQS and refused
    # NOTE: the machine's pace is measured before the burst; beside the suite's other
    # lanes it can slow down between that and the burst (a bound of 3.1 s missed by an
    # admission at 4.75 s, which passed alone). Where a bound is missed, the intake
    # runs again after the burst, and the slower of the two sets the bounds.
    if (max(ttfts) >= _ttft_bound_s(intake_s) or server_gap_s >= _gap_bound_s(intake_s)
            or _median(refusal_s) >= INTAKE_FACTOR * _median(intake_s)):
        with busy_core():  # as the first was
            again = [ended for _, _, ended, *_ in _run_burst(url, num_requests, 16, "none")["rows"]]
        print(f"the same burst without the engine, after it: {_median(again):.2f} s")
        intake_s = max(intake_s, again, key=_median)
    # NOTE: every admitted request, the slowest too (alone: 0.85-1.4 s); without the
    # gate the median alone was 3.9 s.
    ttft_bound_s = _ttft_bound_s(intake_s)
    gap_bound_s = _gap_bound_s(intake_s)
    print(f"admitted first-token bound on this machine: {ttft_bound_s:.2f} s; running "
          f"streams' stall bound: {gap_bound_s:.2f} s")
    assert server_gap_s < gap_bound_s, (gaps, server_gaps, waited)
    # NOTE: and the gap as timed, at twice the bound: a server stall while the reader
    # too was stalled is taken out above, so this keeps a bound on the whole of it
    assert max(gaps) < RAW_GAP_FACTOR * gap_bound_s, (gaps, waited)
    assert max(ttfts) < ttft_bound_s, sorted(ttfts)
    # Refused before the expensive work: by the ingress's gate, not by an engine
    # after being parsed, tokenized and routed (without the gate: none of them). The
    # gate counts requests without a first token; the engines' bound counts the
    # running streams too, so a few refusals still come from an engine.
    assert len(by_gate) >= 0.75 * len(refused), (len(by_gate), len(refused))
    # Refused at once, never after waiting for a slot: at about the pace of the
    # same burst answered without the engine.
    assert _median(refusal_s) < INTAKE_FACTOR * _median(intake_s), (
        _median(refusal_s), _median(intake_s))
