"""1,000 samples through RolloutClient while faults are injected, against a frontend and
three mocker workers (the declared simulator: this is a load and fault test, not a claim
about real-engine behaviour).

Faults: client timeouts shorter than some generations (retried under the same request
ID), connections dropped by cancelling sample tasks mid-stream (the trainer then asks for
those samples again), and one worker killed with SIGKILL mid-stream. Afterwards: every
sample ended admitted or failed with a reason, none was admitted twice, the ledger holds
exactly the (sample_id, request_id) pairs the trainer received, and a reopened ledger
still refuses a second admission."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter

import httpx
import pytest

from rlfleet.rl import (
    AdmittedSample,
    AlreadyAdmitted,
    AttemptClosed,
    AttemptState,
    PartialRolloutPolicy,
    RetryPolicy,
    RolloutClient,
    SampleFailed,
    SampleLedger,
    SamplingSpec,
)

MODEL = "mock-model"
SAMPLES = 1000
CONCURRENCY = 64
WORKER_FLAGS = ("--token-delay", "0.004", "--token-delay-jitter", "0.012")


@pytest.fixture
def fleet(start_fleet):
    # worker 0 is killed mid-run: its slower tokens keep several streams on it then
    # (a fast frontend leaves a worker of this fleet idle most of the time)
    slow = ("--token-delay", "0.02")
    return start_fleet([(*WORKER_FLAGS, *slow), WORKER_FLAGS, WORKER_FLAGS], model=MODEL)


async def test_every_sample_is_admitted_at_most_once_through_faults(fleet, tmp_path):
    rng = random.Random(4)
    path = tmp_path / "ledger.db"
    retry = RetryPolicy(max_attempts=6, backoff_initial=0.01, backoff_max=0.2,
                        attempt_timeout=10.0, reuse_request_id_on_timeout=True)
    received: list[AdmittedSample] = []  # every sample the trainer got, in order
    failed: dict[str, list[str]] = {}
    dropped: list[str] = []
    prompts = {f"s{i}": [rng.randrange(1000, 1128) for _ in range(rng.randint(3, 12))]
               for i in range(SAMPLES)}
    plan = {}
    for i, sid in enumerate(prompts):
        plan[sid] = {
            "route": "sglang" if i % 4 == 0 else "openai",
            "stream": i % 4 != 1,
            "spec": SamplingSpec(max_tokens=rng.randint(8, 16), seed=i),
            # a quarter of the samples: a client timeout shorter than some generations
            "timeout": rng.uniform(0.05, 0.2) if rng.random() < 0.25 else None,
            "drop_after": rng.uniform(0.01, 0.1) if rng.random() < 0.05 else None,
        }

    async with RolloutClient(fleet.url, MODEL, ledger=SampleLedger(path), retry=retry,
                             partial=PartialRolloutPolicy("resume")) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(sid: str, drop: bool) -> None:
            p = plan[sid]
            async with gate:
                task = asyncio.ensure_future(client.generate(
                    sid, prompts[sid], p["spec"], route=p["route"], stream=p["stream"],
                    attempt_timeout=p["timeout"], deadline=time.monotonic() + 30))
                if drop:  # the trainer drops the connection mid-stream
                    await asyncio.wait([task], timeout=p["drop_after"])
                    task.cancel()
                try:
                    received.append(await task)
                except asyncio.CancelledError:
                    dropped.append(sid)
                except SampleFailed as e:
                    failed[sid] = e.reasons

        async def kill_a_worker() -> None:
            """SIGKILL worker 0 a third of the way through, while it streams to several."""
            victim = fleet.workers[0]
            while len(received) < SAMPLES // 3:
                await asyncio.sleep(0.01)
            # killed only while it streams to several (else the kill breaks nothing): on a
            # loaded machine that may take a while, and the gather's own timeout bounds it
            async with httpx.AsyncClient(timeout=5) as http:
                while True:
                    health = (await http.get(f"{fleet.url}/health")).json()
                    busy = [w["inflight"] for w in health["workers"]
                            if w["url"] == victim.ready["url"]]
                    if busy and busy[0] >= 3:
                        break
                    await asyncio.sleep(0.02)
            victim.signal(signal.SIGKILL)

        t0 = time.monotonic()
        async with asyncio.timeout(300):  # a bound, not a timing: loaded CI machines
            killer = asyncio.create_task(kill_a_worker())
            await asyncio.gather(*(one(sid, plan[sid]["drop_after"] is not None)
                                   for sid in prompts))
            assert killer.done(), "the worker was not killed"
            # the trainer asks again for the samples whose connection it dropped
            again = list(dropped)
            dropped.clear()
            await asyncio.gather(*(one(sid, False) for sid in again))
        elapsed = time.monotonic() - t0
        ledger = client.ledger

        # every sample ended admitted or failed with a reason; none was admitted twice
        got = Counter(s.sample_id for s in received)
        assert max(got.values()) == 1
        assert not dropped and set(got) | set(failed) == set(prompts)
        assert not set(got) & set(failed)
        assert all(why and all(why) for why in failed.values())  # each with its reasons
        # only samples with a client timeout shorter than some generations may fail
        unexpected = {s: (plan[s]["timeout"], failed[s]) for s in failed
                      if plan[s]["timeout"] is None or "timeout" not in failed[s]}
        assert not unexpected, f"failed without a short client timeout: {unexpected}"

        # the ledger agrees with what the trainer received
        admitted = ledger.admitted()
        assert {(s, r) for s, (_, r) in admitted.items()} == \
            {(s.sample_id, s.request_id) for s in received}
        assert all(admitted[s.sample_id][0] == s.attempt for s in received)
        records = ledger.attempts()
        assert all(r.state is AttemptState.SUCCEEDED for r in records if r.admitted)
        assert not [r for r in records if r.state in (AttemptState.ACCEPTED,
                                                      AttemptState.STREAMING)]
        for s in received:
            c = s.completion
            assert len(c.token_attempts) == len(c.token_ids) == len(c.logprobs) > 0
            assert c.token_attempts == sorted(c.token_attempts) and c.token_attempts[-1] == s.attempt

        # the faults happened
        reasons = Counter(r.reason.split(":")[0] for r in records if r.reason)
        assert reasons["timeout"] > 0 and reasons["cancelled"] > 0, reasons
        # the kill broke requests under way: the client saw some fail, or the frontend moved
        # them to another worker (those of which nothing had reached the client yet)
        metrics = httpx.get(f"{fleet.url}/metrics", timeout=10).text.splitlines()
        moved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics
                    if line.startswith("rlfleet_frontend_worker_errors_total{"))
        assert reasons["stream_error"] + reasons["http"] + reasons["transport"] + moved > 0, \
            (reasons, moved)
        print(f"\n{SAMPLES} samples in {elapsed:.1f}s: {len(got)} admitted, {len(failed)} "
              f"failed; attempts {len(records)}; reasons {dict(reasons)}; resumed "
              f"{sum(len(set(s.completion.token_attempts)) > 1 for s in received)}")
    ledger.close()  # the trainer stops

    # a restarted trainer reopens the ledger: still one admission per sample
    with SampleLedger(path) as reopened:
        assert reopened.admitted() == admitted
        sid = next(s.sample_id for s in received if s.attempt > 1)
        with pytest.raises(AttemptClosed):
            reopened.admit(sid, 1)  # a late completion of an earlier attempt
        with pytest.raises(AlreadyAdmitted):
            reopened.start(sid, "another-request")
    with SampleLedger(path) as reopened:
        async with RolloutClient(fleet.url, MODEL, ledger=reopened) as client:
            with pytest.raises(AlreadyAdmitted):  # refused before anything is sent
                await client.generate(received[0].sample_id, prompts[received[0].sample_id])
