"""`rlfleet demo`: a real RL training loop on a local fleet.

Makes the test model, starts a frontend with the RL listener and two gated vLLM workers
(file discovery inside OUT, float32, CPU), warms the trainer's copy of the model up to
write digits, and then runs GRPO for `steps` steps:

  rollouts (RolloutClient: G samples per prompt, admission checks, expected policy)
  → trainer recomputes the samples' logprobs and compares them with the engine's
  → one GRPO update → checkpoint OUT/checkpoints/step-N (+ digest)
  → PolicyRefresh of the whole fleet to step-N (verified on every worker) → next step

The task: after a chat prompt, write 8 tokens; the reward is the fraction that are "7".
At the end: OUT/report.json and OUT/report.png. The demo fails (non-zero exit) when a
refresh does not verify every worker, the logprob mismatch reaches 1e-3, the reward does
not improve enough, or it ran out of time. Every process it started is stopped on the
way out, also on Ctrl-C and on failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlfleet.models import make_model
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import Probe
from rlfleet.refresh.transaction import RefreshResult
from rlfleet.rl import RetryPolicy, RolloutClient, SampleLedger, SampleRequest, SamplingSpec
from rlfleet.rollout.gate import RolloutGate
from rlfleet.runtime.launch import Proc
from rlfleet.testing.fleet import LocalFleet
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout
from rlfleet.train.report import plot, write_json
from rlfleet.train.task import SevensTask
from rlfleet.weights.digest import checkpoint_digest

MODEL_NAME = "rlfleet-tiny"
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
#: a greedy probe whose best and second-best logits are closer than this could flip on
#: float noise; the probe prompt is the first candidate that stays clear of it
PROBE_MARGIN = 1e-3
#: what the demo leaves in OUT (cleared at start; other files there are left alone)
OUT_ENTRIES = ("fleet", "checkpoints", "model", "ledger.sqlite", "journal.sqlite",
               "processes.json", "report.json", "report.png")


@dataclass
class DemoConfig:
    out: Path = Path("rlfleet-demo")
    steps: int = 10
    prompts: int = 4  # prompts per step
    group_size: int = 8  # samples per prompt (one request with n = group_size)
    completion_tokens: int = 8
    lr: float = 3e-3  # Adam, GRPO steps
    clip: float = 0.2
    warmup_steps: int = 30
    warmup_lr: float = 1e-2
    warmup_batch: int = 16
    seed: int = 0
    workers: int = 2
    check_learning: bool = True  # last-3 mean reward >= 2 x first step, and >= 2 x chance
    max_logprob_diff: float = 1e-3
    time_limit: float = 900.0
    asynchronous: bool = False  # the loop of rlfleet.demo_async (set by its train_async)
    max_staleness: int = 1  # asynchronous: steps a trained token's policy may lag


class DemoFailed(RuntimeError):
    """A condition the demo requires did not hold; the message says which."""


@dataclass
class DemoRun:
    """What one demo run has done so far (the report is built from it, also on failure)."""

    cfg: DemoConfig
    out: Path
    started: float = field(default_factory=time.monotonic)
    fleet: dict[str, Any] = field(default_factory=dict)
    warmup: dict[str, Any] = field(default_factory=dict)
    initial_refresh: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    final_eval: dict[str, Any] | None = None
    versions: list[dict[str, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    stream: dict[str, Any] | None = None  # the asynchronous loop's totals (StreamStats)
    error: str | None = None


# ---------------------------------------------------------------------- the fleet


def record_processes(out: Path, fleet: LocalFleet) -> None:
    """OUT/processes.json: the process groups this run started, so that the next run can
    stop them should this one be killed before it could."""
    write_json({"pids": [p.pid for p in fleet.procs], "marker": str(out / "fleet")},
               out / "processes.json")


def stop_leftovers(out: Path, timeout: float = 15.0) -> list[int]:
    """Stop the process groups a killed earlier run in OUT left running: only those listed
    in OUT/processes.json whose command line still names OUT's fleet directory."""
    try:
        listed = json.loads((out / "processes.json").read_text())["pids"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    marker = str(out / "fleet").encode()

    def ours(pid: int) -> bool:
        try:
            return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    found = [pid for pid in listed if isinstance(pid, int) and ours(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in found:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout
        while any(map(ours, found)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(map(ours, found)):
            break
    if found:
        print(f"stopped {len(found)} process group(s) left by an earlier run: {found}", flush=True)
    return found


def prepare_out(out: Path) -> None:
    """Stop what a killed earlier run left and remove its files (its discovery entries above
    all); files of other names in OUT are left alone."""
    out.mkdir(parents=True, exist_ok=True)
    stop_leftovers(out)
    for name in OUT_ENTRIES:
        for p in [out / name, *out.glob(f"{name}-*")] if name.endswith(".sqlite") else [out / name]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    (out / "checkpoints").mkdir()


def start_workers(fleet: LocalFleet, model: Path, checkpoints: Path, count: int) -> list[Proc]:
    """Start `count` RL workers, gated until the first refresh verifies them; no wait.
    Unpinned (not as `rlfleet up` starts CPU workers): the demo's tiny model and its trainer,
    in this process, take turns on the cores, and pinned the demo took 45–52 s against
    44–45 s (BENCHMARKS.md, "Refresh at model scale")."""
    return [fleet.start_worker("--model", str(model), "--served-model-name", MODEL_NAME,
                               "--enable-rl", "--system-port", "0", "--start-gated",
                               "--allowed-weights-root", str(checkpoints), *WORKER_FLAGS,
                               wait=False, timeout=600) for _ in range(count)]


async def wait_listed(http: httpx.AsyncClient, rl_url: str, ids: set[int],
                      timeout: float = 60) -> None:
    """Until the RL listener lists every worker in `ids`, with its admin routes."""
    deadline = time.monotonic() + timeout
    while True:
        body = (await http.get(f"{rl_url}/v1/rl/workers", timeout=10)).json()
        listed = {int(w["instance_id"]) for w in body.get("workers", [])
                  if w.get("model") == MODEL_NAME and w.get("routes") and not w.get("error")}
        if ids <= listed:
            return
        if time.monotonic() > deadline:
            raise DemoFailed(f"the RL listener lists workers {sorted(listed)}, expected {sorted(ids)}")
        await asyncio.sleep(0.2)


async def wait_routable(http: httpx.AsyncClient, url: str, ids: set[int],
                        timeout: float = 30) -> None:
    """Until the frontend routes to every worker in `ids` (a reopened worker's discovery
    entry reaches the frontend within a watch interval)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = (await http.get(f"{url}/health", timeout=10)).json()["workers"]
        usable = {int(w["instance_id"]) for w in workers if w["usable"] and w["model"] == MODEL_NAME}
        if ids <= usable:
            return
        if time.monotonic() > deadline:
            raise DemoFailed(f"the frontend routes to workers {sorted(usable)}, expected {sorted(ids)}")
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------- one step's pieces


def choose_probe(trainer: GrpoTrainer, candidates: list[list[int]], n: int
                 ) -> tuple[Probe, float, int]:
    """The refresh probe from the trainer's own model: the first candidate prompt whose
    greedy continuation has no near-tie (else the clearest one)."""
    best: tuple[Probe, float, int] | None = None
    for i, prompt in enumerate(candidates):
        probe, margin = trainer.probe(prompt, n)
        if best is None or margin > best[1]:
            best = (probe, margin, i)
        if margin >= PROBE_MARGIN:
            break
    assert best is not None
    return best


def check_refresh(result: RefreshResult, version: str, digest: str, ids: set[int]) -> None:
    """Every worker of the fleet verified on exactly this version and digest, or fail."""
    verified = {int(w["instance_id"]) for w in result.workers if w["status"] == "verified"}
    problems = []
    if not result.ok:
        problems.append(f"decision {result.decision}: {result.reason}")
    if result.policy.version != version or result.policy.digest != digest:
        problems.append(f"the fleet is on {result.policy.version} / {result.policy.digest}")
    if verified != ids:
        others = "; ".join(f"{w['instance_id']}: {w['status']} ({w['reason']})"
                           for w in result.workers if int(w["instance_id"]) not in verified)
        problems.append(f"verified workers {sorted(verified)}, expected {sorted(ids)}"
                        + (f" ({others})" if others else ""))
    if problems:
        raise DemoFailed(f"refresh to {version} ({digest}) failed: " + "; ".join(problems))


def refresh_record(result: RefreshResult, wall: float) -> dict[str, Any]:
    return {"refresh_id": result.refresh_id, "version": result.policy.version,
            "digest": result.policy.digest, "decision": result.decision, "reason": result.reason,
            "seconds": wall, "phase_seconds": result.step_seconds(),
            "workers": [{"instance_id": w["instance_id"], "status": w["status"]}
                        for w in result.workers]}


async def rollouts(client: RolloutClient, task: SevensTask, cfg: DemoConfig, tag: str
                   ) -> tuple[list[Rollout], int, Counter]:
    """One batch: `prompts` groups of `group_size` samples (one request with n = G each);
    returns the admitted rollouts, the number of sequences not admitted, and why attempts
    failed (a sample's failed attempts are retried; the ledger has them all)."""
    spec = SamplingSpec(max_tokens=cfg.completion_tokens, temperature=1.0,
                        ignore_eos=True)
    reqs = [SampleRequest(f"{tag}/g{g}", p, spec, n=cfg.group_size)
            for g, p in enumerate(task.prompts(cfg.prompts))]
    outcomes = await client.rollout(reqs, concurrency=len(reqs))
    out: list[Rollout] = []
    rejected, reasons = 0, Counter()
    for g, o in enumerate(outcomes):
        reasons.update(a.reason or a.state.value for a in client.ledger.attempts(o.sample_id)
                       if not a.admitted)
        if o.sample is None:
            rejected += cfg.group_size
            continue
        for c in o.sample.completions:
            out.append(Rollout(g, o.sample.prompt_ids, list(c.token_ids), list(c.logprobs),
                               task.reward(c.token_ids)))
    return out, rejected, reasons


def rollout_client(url: str, ledger: Path, gate: RolloutGate) -> RolloutClient:
    """The client checks every response against the expected model and policy (set with
    `expect` after each refresh) and starts no attempt while the refresh's gate is closed."""
    return RolloutClient(url, MODEL_NAME, ledger=SampleLedger(ledger), gate=gate,
                         retry=RetryPolicy(max_attempts=4, backoff_initial=0.2,
                                           attempt_timeout=120))


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# ---------------------------------------------------------------------- the loop


async def train(run: DemoRun, fleet: LocalFleet, trainer: GrpoTrainer, task: SevensTask,
                base: Path, ids: set[int]) -> None:
    cfg, out = run.cfg, run.out
    ckpts = out / "checkpoints"
    rollout_gate = RolloutGate()
    events = run.events
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL_NAME, journal=out / "journal.sqlite",
                                rollout_gate=rollout_gate, min_workers=len(ids), timeout=120,
                                on_event=events.append)
    candidates = [task.prompt(a, b, c) for a, b, c in
                  ((0, 0, 0), (1, 2, 3), (4, 5, 6), (7, 8, 9), (3, 1, 4), (2, 7, 1))]
    run_id = uuid.uuid4().hex[:8]

    async def publish(http: httpx.AsyncClient, client: RolloutClient, step: int
                      ) -> tuple[dict[str, Any], str]:
        """Checkpoint the trainer's policy as step-N, refresh the whole fleet to it, and
        admit only samples of it from now on."""
        version = f"step-{step}"
        path = await asyncio.to_thread(save_checkpoint, trainer.state_dict(), base,
                                       ckpts / version)
        digest = await asyncio.to_thread(checkpoint_digest, path)
        probe, margin, which = choose_probe(trainer, candidates, cfg.completion_tokens)
        t0 = time.monotonic()
        result = await coordinator.refresh(path, version, digest=digest, probe=probe, step=step)
        wall = time.monotonic() - t0
        check_refresh(result, version, digest, ids)
        await wait_routable(http, fleet.url, ids)
        client.expect(version, digest)
        run.versions.append({"version": version, "digest": digest, "path": str(path)})
        if step >= 2:  # keep the policy served and the one before it (for rollback)
            await asyncio.to_thread(shutil.rmtree, ckpts / f"step-{step - 2}", True)
        rec = refresh_record(result, wall)
        rec["probe"] = {"prompt_index": which, "token_ids": probe.token_ids,
                        "min_top2_margin": margin}
        return rec, digest

    async with httpx.AsyncClient() as http, \
            rollout_client(fleet.url, out / "ledger.sqlite", rollout_gate) as client:
        await wait_listed(http, fleet.rl_url, ids)
        run.initial_refresh, digest = await publish(http, client, 0)  # admits the gated workers
        print(f"step-0 (warmed-up policy) on {len(ids)} workers, verified in "
              f"{run.initial_refresh['seconds']:.2f} s; digest {digest}", flush=True)
        print(f"{'step':>4} {'reward':>7} {'refresh':>8} {'admitted':>9} {'rejected':>9} "
              f"{'max|Δlogprob|':>14}  policy", flush=True)
        for step in range(1, cfg.steps + 1):
            policy = run.versions[-1]
            t0 = time.monotonic()
            batch, rejected, reasons = await rollouts(client, task, cfg, f"{run_id}/step{step}")
            t_roll = time.monotonic() - t0
            if not batch:
                raise DemoFailed(f"step {step}: no sample admitted ({dict(reasons)})")
            t0 = time.monotonic()
            stats = trainer.step(batch)
            t_train = time.monotonic() - t0
            refresh, _ = await publish(http, client, step)
            rec = {"step": step, "mean_reward": mean([r.reward for r in batch]),
                   "policy_version": policy["version"], "weight_digest": policy["digest"],
                   "admitted": len(batch), "rejected": rejected,
                   "failed_attempts": dict(reasons),
                   "max_abs_logprob_diff": stats.max_abs_logprob_diff,
                   "mean_abs_logprob_diff": stats.mean_abs_logprob_diff,
                   "loss": stats.loss, "grad_norm": stats.grad_norm,
                   "groups_with_signal": stats.groups_with_signal,
                   "refreshed_to": refresh["version"], "refreshed_digest": refresh["digest"],
                   "refresh_seconds": refresh["seconds"],
                   "refresh_phase_seconds": refresh["phase_seconds"],
                   "refresh": refresh, "rollout_seconds": t_roll, "train_seconds": t_train}
            run.steps.append(rec)
            print(f"{step:>4} {rec['mean_reward']:>7.3f} {refresh['seconds']:>7.2f}s "
                  f"{len(batch):>9} {rejected:>9} {stats.max_abs_logprob_diff:>14.2e}  "
                  f"{policy['version']} -> {refresh['version']}", flush=True)
        # the last policy, measured the same way (no update)
        batch, rejected, reasons = await rollouts(client, task, cfg, f"{run_id}/final")
        run.final_eval = {"step": cfg.steps + 1, "policy_version": run.versions[-1]["version"],
                          "weight_digest": run.versions[-1]["digest"],
                          "mean_reward": mean([r.reward for r in batch]),
                          "admitted": len(batch), "rejected": rejected}
        print(f"final policy {run.final_eval['policy_version']}: mean reward "
              f"{run.final_eval['mean_reward']:.3f}", flush=True)


# ---------------------------------------------------------------------- report and checks


def build_report(run: DemoRun) -> dict[str, Any]:
    cfg = run.cfg
    steps = run.steps
    rewards = [s["mean_reward"] for s in steps]
    first = rewards[0] if rewards else None
    last3 = mean(rewards[-3:]) if rewards else None
    chance = 1 / 10
    failures: list[str] = []
    if run.error:
        failures.append(run.error)
    if len(steps) < cfg.steps:
        failures.append(f"only {len(steps)} of {cfg.steps} steps ran")
    diff = max((s["max_abs_logprob_diff"] for s in steps), default=None)
    if diff is not None and not diff < cfg.max_logprob_diff:
        failures.append(f"the largest trainer/engine logprob difference is {diff:.2e}, "
                        f"not below {cfg.max_logprob_diff:g}")
    if cfg.check_learning and rewards:
        if not last3 >= 2 * first:
            failures.append(f"the mean reward of the last 3 steps ({last3:.3f}) is not at "
                            f"least twice the first step's ({first:.3f})")
        if not last3 >= 2 * chance:
            failures.append(f"the mean reward of the last 3 steps ({last3:.3f}) is not clearly "
                            f"above chance ({chance:.2f}): below {2 * chance:.2f}")
    total = time.monotonic() - run.started
    if total > cfg.time_limit:
        failures.append(f"the demo took {total:.0f} s, over its {cfg.time_limit:.0f} s limit")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {
        "task": {"name": "sevens", "description": "after a chat prompt, write "
                 f"{cfg.completion_tokens} tokens (ignore_eos); reward = fraction equal to the "
                 "digit '7' (token 22)", "target_token_id": 22, "chance_reward": chance},
        "config": config,
        "fleet": {**run.fleet, "versions": run.versions},
        "warmup": run.warmup,
        "initial_refresh": run.initial_refresh,
        "steps": steps,
        "final_eval": run.final_eval,
        "first_step_reward": first,
        "last3_mean_reward": last3,
        "max_abs_logprob_diff": diff,
        "phase_seconds": run.phases,
        "total_seconds": total,
        "checks": {"max_logprob_diff_limit": cfg.max_logprob_diff,
                   "learning_checked": cfg.check_learning, "time_limit": cfg.time_limit},
        "refresh_events": run.events,
        **({"stream": run.stream} if run.stream is not None else {}),
        "ok": not failures,
        "failures": failures,
    }


# ---------------------------------------------------------------------- entry point


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(cfg: DemoConfig, loop: TrainLoop | None = None) -> dict[str, Any]:
    """Run the demo (`loop`: the training loop, default `train`'s synchronous one; its
    asynchronous one is rlfleet.demo_async.train_async); returns the report (also written
    to OUT/report.json). `report["ok"]` says whether every condition held;
    `report["failures"]` says which did not. Ctrl-C
    (and SIGTERM) stop the fleet and re-raise KeyboardInterrupt; other errors stop it and
    propagate, after the report of what ran is written."""
    out = Path(cfg.out).resolve()
    run = DemoRun(cfg, out)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    prepared = False
    try:
        prepare_out(out)
        prepared = True
        _run(run, loop or sync_loop)
    except DemoFailed as e:
        run.error = str(e)
    except BaseException as e:
        run.error = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if prepared:
            report = build_report(run)
            write_json(report, out / "report.json")
            if run.steps:
                plot(report, out / "report.png")
    return report


def sync_loop(run: DemoRun, fleet: LocalFleet, trainer: GrpoTrainer, task: SevensTask,
              base: Path, ids: set[int]) -> None:
    asyncio.run(train(run, fleet, trainer, task, base, ids))


TrainLoop = Callable[[DemoRun, LocalFleet, GrpoTrainer, SevensTask, Path, set[int]], None]


def _run(run: DemoRun, loop: TrainLoop) -> None:
    cfg, out = run.cfg, run.out
    t0 = time.monotonic()
    base = make_model(out / "model", size="tiny", seed=cfg.seed, dtype="float32")
    # a namespace of its own: nothing registered by another fleet can join this one
    namespace = f"rlfleet-demo-{uuid.uuid4().hex[:8]}"
    with LocalFleet(out / "fleet", namespace=namespace, lease_ttl=5) as fleet:
        fleet.start_frontend(enable_rl=True)
        record_processes(out, fleet)
        procs = start_workers(fleet, base, out / "checkpoints", cfg.workers)
        record_processes(out, fleet)
        run.fleet = {"model": MODEL_NAME, "base_checkpoint": str(base), "frontend": fleet.url,
                     "rl_url": fleet.rl_url, "discovery": fleet.discovery,
                     "namespace": namespace, "pids": [p.pid for p in fleet.procs], "workers": []}
        print(f"frontend {fleet.url} (RL listener {fleet.rl_url}); starting {cfg.workers} "
              f"vLLM workers, gated", flush=True)
        # the trainer loads and warms up while the workers start
        t1 = time.monotonic()
        trainer = GrpoTrainer(base, lr=cfg.lr, clip=cfg.clip, seed=cfg.seed)
        task = SevensTask(base, length=cfg.completion_tokens)

        def batch() -> tuple[list[list[int]], list[list[int]]]:
            prompts = task.prompts(cfg.warmup_batch)
            return prompts, [task.random_digits() for _ in prompts]

        losses = trainer.warm_up(batch, cfg.warmup_steps, lr=cfg.warmup_lr)
        run.warmup = {"steps": cfg.warmup_steps, "lr": cfg.warmup_lr, "batch": cfg.warmup_batch,
                      "first_loss": losses[0], "last_loss": losses[-1],
                      "seconds": time.monotonic() - t1}
        print(f"warm-up: {cfg.warmup_steps} supervised steps, cross-entropy {losses[0]:.2f} -> "
              f"{losses[-1]:.2f} (uniform digits: 2.30), {run.warmup['seconds']:.0f} s", flush=True)
        for p in procs:
            p.wait_ready(600)
        run.phases["startup"] = time.monotonic() - t0
        run.fleet["workers"] = [
            {"instance_id": int(p.ready["instance_id"]), "url": p.ready["url"],
             "system_url": p.ready["system_url"], "model": p.ready["model"], "pid": p.pid,
             "log": str(p.log_path)} for p in procs]
        for w in run.fleet["workers"]:
            print(f"worker {w['instance_id']} ready: {w['url']} (system {w['system_url']})",
                  flush=True)
        ids = {w["instance_id"] for w in run.fleet["workers"]}
        t2 = time.monotonic()
        try:
            loop(run, fleet, trainer, task, base, ids)
        finally:
            run.phases["training"] = time.monotonic() - t2
            print("stopping the fleet", flush=True)
    print("fleet stopped", flush=True)
