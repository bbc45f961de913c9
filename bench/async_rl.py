"""The asynchronous RL loop (Fleet.stream_rollouts) against the synchronous one, same
trainer, same fleet:

- the trainer: the demo's GRPO trainer (rlfleet.train.grpo) on the demo's tiny float32
  model, real torch forward/backward passes and Adam steps, plus a checkpoint written
  after every step;
- the fleet: a frontend and 2 mocker workers (a declared simulator, not an engine: fixed
  seconds per generated token, `--token-delay`, all of a request's choices together, so
  that generation and training can overlap on 2 cores), paced so that a batch's
  generation takes GEN_RATIO × the measured trainer step; each step moves the fleet to a
  new (simulated) policy: a synchronous refresh in the sync loop, a rolling one in the
  async loop.

    python bench/async_rl.py [--steps 12] [--prompts 8] [--group-size 8] [--gen-ratio 0.8]

Sync: roll out a batch, train, refresh, repeat. Async at max_staleness 1 and 2: the
stream produces while the trainer trains. For each: optimizer steps per hour, trainer
idle fraction (waiting for samples or for a refresh), fleet idle fraction (no request in
flight; a request held by the frontend for a newer policy counts as in flight, so this is
a lower bound), and the mean and max staleness of the trained tokens, counted over every
trained token from its span's policy step, and the trainer's seconds per step (on a small
shared machine the fleet's processes slow the overlapped trainer down). Last line: one
JSON object."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.models import make_model
from rlfleet.models.tokenizer import VOCAB_SIZE
from rlfleet.rl import Fleet, PolicyRefresh, RetryPolicy, SampleRequest, SamplingSpec
from rlfleet.rl.stream import numbered, sample_steps
from rlfleet.testing.fleet import LocalFleet
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout
from rlfleet.train.task import SevensTask

MODEL = "bench-async"


def rollouts_of(samples, task: SevensTask) -> list[Rollout]:
    return [Rollout(g, s.prompt_ids, list(c.token_ids), list(c.logprobs), task.reward(c.token_ids))
            for g, s in enumerate(samples) for c in s.completions]


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.base = make_model(work / "model", size="tiny", seed=0, dtype="float32")
        self.task = SevensTask(self.base, length=args.tokens)
        self.trainer = GrpoTrainer(self.base, lr=1e-4, seed=0, threads=1)
        self.spec = SamplingSpec(max_tokens=args.tokens, ignore_eos=True)
        self.seed = 1000

    def request(self, tag: str):
        return lambda i: SampleRequest(f"{tag}-{i}", self.task.prompts(1)[0], self.spec,
                                       n=self.args.group_size)

    def train(self, samples, tag: str, step: int) -> float:
        """One optimizer step and its checkpoint; the seconds it took."""
        t0 = time.monotonic()
        self.trainer.step(rollouts_of(samples, self.task))
        save_checkpoint(self.trainer.state_dict(), self.base, self.work / "ckpt" / tag)
        return time.monotonic() - t0

    def policy(self, tag: str) -> tuple[Path, str]:
        """The next simulated policy for the mocker fleet (its weights are one seed)."""
        self.seed += 1
        return write_mock_checkpoint(self.work / "mock" / f"{tag}-{self.seed}", self.seed), \
            f"mock:{self.seed}"

    def calibrate(self) -> float:
        """The trainer's step on a batch of the bench's shape (median of 3, after one)."""
        a = self.args
        fake = [Rollout(g, self.task.prompts(1)[0], self.task.random_digits(), [-2.3] * a.tokens,
                        float(g % 2)) for g in range(a.prompts) for _ in range(a.group_size)]
        times = []
        for _ in range(4):
            t0 = time.monotonic()
            self.trainer.step(fake)
            save_checkpoint(self.trainer.state_dict(), self.base, self.work / "ckpt" / "cal")
            times.append(time.monotonic() - t0)
        return statistics.median(times[1:])


def sync_run(b: Bench, fleet_url: str, rl_url: str, journal: str) -> dict:
    a = b.args
    fleet = Fleet(fleet_url, MODEL, rl_url=rl_url, journal=journal, timeout=30,
                  retry=RetryPolicy(4, backoff_initial=0.1, attempt_timeout=60))
    make = b.request("sync")
    roll = train = refresh = 0.0
    tokens = 0
    try:
        path, digest = b.policy("sync")
        first = fleet.refresh(path, f"sync-{b.seed}", digest=digest)
        step0 = first.policy.step
        t_start = time.monotonic()
        for k in range(a.steps):
            t0 = time.monotonic()
            outs = fleet.rollout([make(k * a.prompts + j) for j in range(a.prompts)])
            samples = [o.sample for o in outs if o.sample is not None]
            roll += time.monotonic() - t0
            for s in samples:  # trained at step0 + k: staleness from the spans (all 0 here)
                for st, n in sample_steps(s):
                    assert st == step0 + k, (st, step0 + k)
                    tokens += n
            train += b.train(samples, "sync", k)
            t0 = time.monotonic()
            path, digest = b.policy("sync")
            r = fleet.refresh(path, f"sync-{b.seed}", digest=digest, step=step0 + k + 1)
            assert r.fleet_moved, r.reason
            refresh += time.monotonic() - t0
        wall = time.monotonic() - t_start
    finally:
        fleet.close()
    return {"mode": "sync", "steps": a.steps, "seconds": wall,
            "steps_per_hour": a.steps / wall * 3600, "trainer_idle": 1 - train / wall,
            "fleet_idle": 1 - roll / wall, "mean_staleness": 0.0, "max_staleness_seen": 0,
            "tokens_trained": tokens, "tokens_beyond_bound": 0,
            "rollout_seconds": roll, "train_seconds": train, "refresh_seconds": refresh}


def async_run(b: Bench, fleet_url: str, rl_url: str, journal: str, s: int) -> dict:
    a = b.args
    sync = PolicyRefresh(rl_url, model=MODEL, journal=journal, timeout=30)
    try:  # a rolling refresh starts from a fleet whose workers declare a step
        path, digest = b.policy(f"a{s}")
        first = asyncio.run(sync.refresh(path, f"a{s}-{b.seed}", digest=digest))
    finally:
        sync.close()
    fleet = Fleet(fleet_url, MODEL, rl_url=rl_url, journal=journal, mode="rolling",
                  max_lag=s + 1, min_serving=1, timeout=30, pause_mode="keep",
                  retry=RetryPolicy(4, backoff_initial=0.1, attempt_timeout=60))
    train, beyond, tokens = 0.0, 0, 0
    try:
        stream = fleet.stream_rollouts(numbered(b.request(f"a{s}")), a.prompts, max_staleness=s,
                                       start_step=first.policy.step)
        t_start = time.monotonic()
        for k in range(a.steps):
            batch = stream.next_batch(timeout=300)
            for x in batch:  # counted from the spans, independently of the stream's stats
                for st, n in sample_steps(x.sample):
                    tokens += n
                    beyond += n if x.trainer_step - st > s else 0
            train += b.train([x.sample for x in batch], f"a{s}", k)
            path, digest = b.policy(f"a{s}")
            stream.publish(path, f"a{s}-{b.seed}", digest=digest)
        wall = time.monotonic() - t_start
        stream.close()
        st = stream.stats.summary()
    finally:
        fleet.close()
    moved = [r for r in st["refreshes"] if r["decision"] == "reopened"]
    return {"mode": f"async s={s}", "steps": a.steps, "seconds": wall,
            "steps_per_hour": a.steps / wall * 3600,
            "trainer_idle": st["trainer_idle_fraction"], "fleet_idle": st["fleet_idle_fraction"],
            "mean_staleness": st["mean_staleness"], "max_staleness_seen": st["max_staleness_seen"],
            "tokens_trained": tokens, "tokens_beyond_bound": beyond,
            "tokens_by_staleness": st["tokens_by_staleness"], "dropped_stale": st["dropped_stale"],
            "train_seconds": train, "refreshes_reopened": len(moved),
            "refresh_modes": sorted({r["mode"] for r in moved})}


def combine(rs: list[dict]) -> dict:
    """One mode's rounds as one run: rates and fractions over the summed time, staleness
    over every trained token."""
    wall, steps = sum(r["seconds"] for r in rs), sum(r["steps"] for r in rs)
    out = {**rs[-1], "rounds": len(rs), "seconds": wall, "steps": steps,
           "steps_per_hour": steps / wall * 3600,
           "tokens_trained": sum(r["tokens_trained"] for r in rs),
           "train_seconds": sum(r["train_seconds"] for r in rs),
           "tokens_beyond_bound": sum(r["tokens_beyond_bound"] for r in rs),
           "max_staleness_seen": max(r["max_staleness_seen"] for r in rs),
           "per_round_steps_per_hour": [r["steps_per_hour"] for r in rs]}
    for k in ("trainer_idle", "fleet_idle"):
        out[k] = sum(r[k] * r["seconds"] for r in rs) / wall
    out["mean_staleness"] = sum(r["mean_staleness"] * r["tokens_trained"] for r in rs) / \
        max(1, out["tokens_trained"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=8, help="requests (groups) per batch")
    p.add_argument("--group-size", type=int, default=8, help="choices per request (n)")
    p.add_argument("--tokens", type=int, default=8, help="generated tokens per choice")
    p.add_argument("--gen-ratio", type=float, default=0.8,
                   help="a batch's generation time / the trainer's step time")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each mode, interleaved; the figures are over all of them")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-async-") as tmp:
        work = Path(tmp)
        b = Bench(a, work)
        t_step = b.calibrate()
        delay = a.gen_ratio * t_step / a.tokens
        print(f"trainer step (GRPO on {a.prompts}x{a.group_size} sequences + checkpoint): "
              f"{t_step:.3f} s; mocker pace {delay * 1000:.1f} ms/token -> "
              f"~{delay * a.tokens:.2f} s per batch", flush=True)
        with LocalFleet(work / "fleet", lease_ttl=3) as lf:
            lf.start_frontend(enable_rl=True)
            for _ in range(2):
                lf.start_worker("--served-model-name", MODEL, "--enable-rl", "--system-port", "0",
                                "--allowed-weights-root", str(work / "mock"),
                                "--vocab-size", str(VOCAB_SIZE), "--token-delay", f"{delay:.6f}",
                                "--seed", "1", kind="mocker", wait=False, timeout=120)
            for w in lf.workers:
                w.wait_ready(120)
            (work / "mock").mkdir(exist_ok=True)
            runs: dict[str, list[dict]] = {}
            for r in range(a.rounds):  # interleaved, so that a busy moment hits every mode
                one = sync_run(b, lf.url, lf.rl_url, str(work / f"j-sync-{r}.sqlite"))
                runs.setdefault("sync", []).append(one)
                for s in (1, 2):
                    one = async_run(b, lf.url, lf.rl_url, str(work / f"j-a{s}-{r}.sqlite"), s)
                    runs.setdefault(one["mode"], []).append(one)
            results = [combine(rs) for rs in runs.values()]
    base = results[0]["steps_per_hour"]
    print(f"{'mode':<12} {'steps/h':>9} {'×sync':>6} {'trainer idle':>13} {'fleet idle':>11} "
          f"{'mean stale':>11} {'max stale':>10} {'beyond':>7} {'train s/step':>13}")
    for r in results:
        print(f"{r['mode']:<12} {r['steps_per_hour']:>9.0f} {r['steps_per_hour'] / base:>6.2f} "
              f"{r['trainer_idle']:>13.1%} {r['fleet_idle']:>11.1%} {r['mean_staleness']:>11.2f} "
              f"{r['max_staleness_seen']:>10} {r['tokens_beyond_bound']:>7} "
              f"{r['train_seconds'] / r['steps']:>13.2f}")
    print(json.dumps({"details": results}), file=sys.stderr)
    s1, s2 = results[1], results[2]
    print(json.dumps({"speedup_s1": round(s1["steps_per_hour"] / base, 3),
                      "speedup_s2": round(s2["steps_per_hour"] / base, 3),
                      "trainer_idle_s1": round(s1["trainer_idle"], 4),
                      "max_staleness_seen_s1": s1["max_staleness_seen"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
