"""A policy refresh at model scale, measured as a user feels it, on a fleet of two vLLM workers
(bf16, the Qwen3-0.6B geometry with --size small, Qwen3-1.7B's with --size medium), every
figure side by side in one run:

- **serving gap**: streams run on every worker across a refresh (stage first, then one
  commit call that pauses in keep mode for the swap); per worker, the longest interval with
  no token while it has streams in flight, beside the engine's own swap (the commit's apply
  step). Each stream must finish whole, its per-token spans naming both policies
  (`inflight_kept`).
- **the disk path's whole refresh** (gate, pause, reload from disk, verify, resume and
  self-check, reopen, probe) beside the **bare reload** of the same checkpoint (both paused
  workers' update_weights_from_disk at once).
- **publish → every worker serving it** (reopened, its self-check passed; every refresh runs
  as `Fleet.refresh` runs it, the probe after the reopen), per path: from disk; staged (the
  default: the checkpoint read once, straight into each engine's shadow, while it serves;
  the figure is a staged refresh after a staged refresh, as in an RL run, the workers'
  first one beside it);
  staged from a published XOR delta; vLLM's four-phase weight transfer through the fleet's one URL (the
  `modelexpress` backend, versions in S3). Publishing a checkpoint is the same trainer-side
  write for the first two (measured once); the delta and the S3 version are published by
  rlfleet's publisher in a process of their own.
- **base tok/s while staging**: streams on both workers, tokens per second while both stage
  a version (the engine preparing its shadow) ÷ the same streams just before.

- Every checkpoint is read once before the phases: each path reads it from the page cache,
  as it reads a checkpoint the trainer has just written.
- **memory over refreshes** (`--memory-refreshes N`): N staged refreshes in a row, the
  resident memory of each worker and of its engine core after each (a shadow kept alive
  shows as a copy of the weights per refresh).

    python bench/refresh.py --size small     # and --size medium
    python bench/refresh.py --size small --memory-refreshes 4 \
        --skip disk,staged,tok/s,gap,delta,four-phase

The last line is JSON: serving_gap_over_apply, refresh_over_bare_reload,
staged_end_to_end_over_disk, base_tok_s_during_stage_ratio, inflight_kept, and every figure
they come from. Run it alone on the box (/work/wt/heavy)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from rlfleet.models import make_model
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.runtime.launch import free_port, spawn, worker_cores
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.s3 import BUCKET, S3Server
from rlfleet.weights.digest import checkpoint_digest

MODEL = "bench"
PROMPT = [151644, 872, 198, 15, 16, 17]


# ------------------------------------------------------------------ streams across a refresh

class Stream:
    """A streamed generation on one worker's request plane, read in a thread: the arrival
    time of every token, its finish and the per-token policy spans."""

    def __init__(self, url: str, rid: str, tokens: int, temperature: float = 1.0) -> None:
        self.worker, self.tokens = url, tokens
        self.times: list[float] = []
        self.spans: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.stopping = False
        body = {"request_id": rid, "prompt_token_ids": PROMPT, "stream": True,
                "sampling": {"temperature": temperature, "max_tokens": tokens,
                             "ignore_eos": True, "logprobs": 0}}
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()

    def _run(self, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{self.worker}/generate", json=body, timeout=1800) as r:
                for line in r.iter_lines():
                    if self.stopping:
                        return  # the connection closes: the worker aborts the request
                    if line:
                        self._event(json.loads(line))
        except httpx.HTTPError as e:
            self.error = repr(e)

    def _event(self, ev: dict[str, Any]) -> None:
        if "error" in ev:
            self.error = str(ev["error"])
        for c in ev.get("choices", []):
            now = time.monotonic()
            self.times += [now] * len(c.get("token_ids") or [])
            self.spans = c.get("weight_versions") or self.spans
            self.finish = c.get("finish_reason") or self.finish

    def wait_tokens(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < n and self.thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.times)} of {n} tokens arrived")
            time.sleep(0.01)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(60)

    def kept(self, old: str, new: str) -> bool:
        """Finished whole, its spans naming both policies, the old one first."""
        versions = [s["version"] for s in self.spans]
        return (self.error is None and self.finish == "length"
                and len(self.times) == self.tokens and versions == [old, new]
                and self.spans[0]["start"] == 0 and self.spans[-1]["end"] == self.tokens)


def serving_gap(streams: list[Stream], t0: float, t1: float) -> float:
    """The longest interval within [t0, t1] with no token from `streams` while one of them
    is in flight (between its first and its last token)."""
    times = sorted(t for s in streams for t in s.times)
    spans = [(s.times[0], s.times[-1]) for s in streams if s.times]
    gap = 0.0
    for a, b in zip(times, times[1:], strict=False):
        if b > t0 and a < t1 and any(lo <= a and b <= hi for lo, hi in spans):
            gap = max(gap, b - a)
    return gap


def decode_step(streams: list[Stream], before: float) -> float:
    """The median interval between a worker's tokens before `before` (its streams batched:
    one decode step emits a token on each), the interval a swap adds to at the least."""
    times = sorted(t for s in streams for t in s.times if t < before)
    steps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b - a > 1e-3)
    return steps[len(steps) // 2] if steps else 0.0


# ------------------------------------------------------------------ helpers

class MemoryWatch:
    """Samples, in a thread, the resident memory of the workers' processes (each worker and
    its engine, anonymous and shared) and the host's MemAvailable: the peaks, per phase."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.phase = pids, "start"
        self.peaks: dict[str, dict[str, float]] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _status(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as f:
                return sum(int(line.split()[1]) for line in f
                           if line.startswith(("RssAnon:", "RssShmem:"))) * 1024
        except OSError:
            return 0

    @staticmethod
    def rss(pids: list[int]) -> int:
        """The resident bytes (anonymous and shared) of `pids`, together."""
        return sum(map(MemoryWatch._status, pids))

    @staticmethod
    def children(pid: int) -> list[int]:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return list(map(int, kids.stdout.split()))

    def _tree(self) -> list[int]:
        return [p for pid in self.pids for p in (pid, *self.children(pid))]

    def _run(self) -> None:
        tree = self._tree()
        while not self.stopped.wait(0.5):
            used = self.rss(tree) / 2**30
            with open("/proc/meminfo") as f:
                avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:"))
            peak = self.peaks.setdefault(self.phase, {"workers_gib": 0.0, "min_available_gib": 1e9})
            peak["workers_gib"] = round(max(peak["workers_gib"], used), 2)
            peak["min_available_gib"] = round(min(peak["min_available_gib"], avail / 2**20), 2)

    def stop(self) -> dict[str, dict[str, float]]:
        self.stopped.set()
        self.thread.join(5)
        return self.peaks


def post(url: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body if body is not None else {}, timeout=1800, **kw)
    r.raise_for_status()
    return r.json()


def publish(ckpt: Path, version: str, to: str, base: str | None = None,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """rlfleet's publisher in a process of its own (the trainer's), its memory freed after:
    what it reports (digest, bytes, seconds)."""
    code = ("import json, sys; from rlfleet.weights.publish import publish; "
            "r = publish(sys.argv[1], sys.argv[2], to=sys.argv[3], base=sys.argv[4] or None, "
            "model='bench', endpoint_url=sys.argv[5] or None); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(ckpt), version, to, base or "",
                          (env or {}).get("S3_ENDPOINT", "")], capture_output=True, text=True,
                         check=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit_applies(result, steps: tuple[str, ...] = ("apply",)) -> dict[str, float]:
    """Each worker's swap: the apply step of its commit call (or the sum of `steps`), by
    system URL."""
    return {w["system_url"]: sum(c.get("seconds", 0.0) for c in w["calls"]
                                 if c["step"] in steps and c.get("via")) for w in result.workers}


def staged_how(result) -> list[str]:
    """How the workers staged: the engine's way of preparing ("fallback": it did not)."""
    return sorted({c["body"].get("prepared") or "fallback" for w in result.workers
                   for c in w["calls"] if c["step"] == "stage"})


def prepare_seconds(result) -> list[float | None]:
    """Each worker's build of the shadow (the engine's own seconds, from its stage call)."""
    return [c["body"].get("prepare_seconds") for w in result.workers for c in w["calls"]
            if c["step"] == "stage"]


def ok(result) -> None:
    if not result.ok or not result.fleet_moved:
        raise RuntimeError(f"refresh {result.refresh_id}: {result.decision}: {result.reason}")


def bare_reload(urls: list[str], path: Path, version: str) -> float:
    """Both workers paused, then their update_weights_from_disk at once: the seconds."""
    for u in urls:
        post(u, "/engine/pause_generation", {"mode": "wait"})
    t0 = time.perf_counter()
    threads_out: list[dict[str, Any]] = []

    def one(u: str) -> None:
        threads_out.append(post(u, "/engine/update_weights_from_disk",
                                {"model_path": str(path), "weight_version": version}))
    ts = [threading.Thread(target=one, args=(u,)) for u in urls]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.perf_counter() - t0
    for u in urls:
        post(u, "/engine/resume_generation")
    bad = [r for r in threads_out if r.get("status") != "ok"]
    if bad or len(threads_out) != len(urls):
        raise RuntimeError(f"bare reload failed: {bad}")
    return secs


def save_seconds(ckpt: Path, out: Path) -> float:
    """What the trainer's write of a checkpoint of this size takes (in a process of its own,
    as a trainer writes it from memory): the same for the disk and the default staged path."""
    code = ("import sys, time; from rlfleet.train.checkpoint import save_checkpoint; "
            "from rlfleet.weights.digest import iter_checkpoint_tensors; "
            "t = {n: x.clone() for n, x in iter_checkpoint_tensors(sys.argv[1])}; "
            "t0 = time.perf_counter(); save_checkpoint(t, sys.argv[1], sys.argv[2]); "
            "print(time.perf_counter() - t0)")
    out_ = subprocess.run([sys.executable, "-c", code, str(ckpt), str(out)],
                          capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return float(out_.stdout.strip().splitlines()[-1])


class Bench:
    """The fleet and what every measurement shares."""

    def __init__(self, args: argparse.Namespace, work: Path, fleet: LocalFleet,
                 ckpts: dict[str, Path], s3: S3Server) -> None:
        self.args, self.work, self.fleet, self.ckpts, self.s3 = args, work, fleet, ckpts, s3
        self.urls = [w.ready["url"] for w in fleet.workers]
        self.systems = [w.ready["system_url"] for w in fleet.workers]
        self.journal = work / "journal.sqlite"
        self.events: list[tuple[float, str]] = []
        self.on_events: list[Any] = []  # called with each event (the serving-gap phase)
        self.serving: dict[str, float] = {}  # version -> seconds until every worker served it
        self.out: dict[str, Any] = {}
        self.started = time.monotonic()  # the refresh in progress (its events' times)

    def coordinator(self, path: str, **kw: Any) -> PolicyRefresh:
        """As `Fleet.refresh` and `rlfleet refresh` refresh (the probe after the reopen)."""
        return PolicyRefresh(self.fleet.rl_url, model=MODEL, path=path, journal=self.journal,
                             timeout=1200, on_event=self._event, probe_after_reopen=True, **kw)

    def _event(self, msg: str) -> None:
        now = time.monotonic()
        self.events.append((now, msg))
        print(f"  {now - self.started:8.3f} {msg}", flush=True)
        for hook in self.on_events:
            hook(msg)

    def refresh(self, path: str, version: str, ckpt: Path | None = None, **kw: Any):
        self.started = time.monotonic()
        coord = self.coordinator(path, pause_mode=kw.pop("pause_mode", "wait"))
        try:
            t0 = time.monotonic()
            result = asyncio.run(coord.refresh(ckpt, version, **kw))
            secs = time.monotonic() - t0
        finally:
            coord.close()
        ok(result)
        # serving: every worker reopened on it (its self-check passed); the probe follows
        reopened = [t for t, m in self.events if t >= t0 and " reopen done in " in m]
        self.serving[version] = (reopened[-1] if reopened else t0 + secs) - t0
        print(f"{path} refresh to {version}: {secs:.3f} s (serving after "
              f"{self.serving[version]:.3f} s) "
              f"{ {k: round(v, 3) for k, v in result.step_seconds().items()} }", flush=True)
        return result, secs

    # ---------------------------------------------------------------- the measurements

    def disk_and_bare(self) -> None:
        """The bare reload of B (and back to A), then the disk path's refresh to B."""
        b, a = self.ckpts["B"], self.ckpts["A"]
        self.out["bare_reload_s"] = bare_reload(self.systems, b, "bare-B")
        bare_reload(self.systems, a, "bare-A")
        result, secs = self.refresh("vllm-disk", "disk-B", b, digest=checkpoint_digest(b))
        self.out["disk_refresh_s"] = secs
        self.out["disk_serving_s"] = self.serving["disk-B"]
        self.out["disk_steps_s"] = {k: round(v, 3) for k, v in result.step_seconds().items()}
        self.out["disk_apply_s"] = max(commit_applies(result).values())

    def staged(self) -> None:
        """The default path (stage first, from the checkpoint, digest from the workers): to A,
        the workers' first staged refresh (`staged_first_*`), then to C, the figure: an RL
        run refreshes every step, so its refresh comes after a refresh (each engine's builder
        then reuses the pages the last shadow freed; the first faults them in)."""
        result, _ = self.refresh("vllm-staged", "staged-A", self.ckpts["A"])
        self.out["staged_first_serving_s"] = self.serving["staged-A"]
        self.out["staged_first_prepare_s"] = prepare_seconds(result)
        result, secs = self.refresh("vllm-staged", "staged-C", self.ckpts["C"])
        self.out["staged_refresh_s"] = secs
        self.out["staged_serving_s"] = self.serving["staged-C"]
        self.out["staged_steps_s"] = {k: round(v, 3) for k, v in result.step_seconds().items()}
        self.out["staged_apply_s"] = max(commit_applies(result).values())
        self.out["staged_how"] = staged_how(result)
        self.out["staged_prepare_s"] = prepare_seconds(result)

    def delta(self) -> None:
        """A published full version (vA) staged, then B published as an XOR delta on it and
        staged: each from publish to serving."""
        store = self.work / "versions"
        for version, ckpt, base in (("vA", self.ckpts["A"], None), ("vB", self.ckpts["B"], "vA")):
            pub = publish(ckpt, version, f"file://{store}", base)
            result, secs = self.refresh("vllm-staged", version, digest=pub["digest"],
                                        source={"kind": "disk", "path": str(store / version)})
            key = "delta" if base else "full_artifact"
            self.out[f"{key}_publish_s"] = pub["seconds"]
            self.out[f"{key}_refresh_s"] = secs
            self.out[f"{key}_end_to_end_s"] = pub["seconds"] + self.serving[version]
            self.out[f"{key}_how"] = sorted({c["body"].get("prepared") or "reload"
                                             for w in result.workers for c in w["calls"]
                                             if c["step"] == "stage" and c["route"] == "staged"})

    def four_phase(self) -> None:
        """vLLM's client through the fleet's one URL: C published to S3, then start, update,
        finish (a whole transaction of its own, the fleet paused only inside it)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        prefix = f"s3://{BUCKET}/bench"
        pub = publish(self.ckpts["C"], "mxC", prefix,
                      env={**self.s3.env, "S3_ENDPOINT": self.s3.endpoint_url})
        client = HTTPVLLMWeightSyncClient(self.fleet.url, timeout=1800)
        client.init_weight_transfer_engine({
            "object_storage_type": "S3", "initial_base_version_id": "seed",
            "seed_checkpoint_path": str(self.ckpts["A"]),
            "refit_checkpoint_dir": str(self.work / "refit"),
            "object_storage_endpoint_url": self.s3.endpoint_url,
            "object_storage_uri_prefix": prefix})
        t0 = time.perf_counter()
        client.start_weight_update()
        client.update_weights({"version_id": "mxC"})
        client.finish_weight_update("mxC")
        secs = time.perf_counter() - t0
        self.out["four_phase_publish_s"] = pub["seconds"]
        self.out["four_phase_transfer_s"] = secs
        self.out["four_phase_end_to_end_s"] = pub["seconds"] + secs
        print(f"four-phase transfer to mxC: {secs:.3f} s", flush=True)

    def tokens_per_s_while_staging(self) -> None:
        """Streams on both workers: tokens/s while both stage A (into their shadows) ÷ the
        same streams in a window of the same length just before; the staged handles are then
        released. Also the per-stream rate, for sizing the serving-gap streams."""
        n = self.args.streams
        room = self.args.max_model_len - len(PROMPT) - 1
        streams = [Stream(u, f"tps-{i}-{j}", room) for i, u in enumerate(self.urls)
                   for j in range(n)]
        for s in streams:
            s.wait_tokens(4)
        t0 = time.monotonic()
        handles = [post(sys_url, "/engine/stage_weights", {
            "version": "tps-A", "source": {"kind": "disk", "path": str(self.ckpts["A"])}})
            ["handle"] for sys_url in self.systems]
        for sys_url, h in zip(self.systems, handles, strict=True):
            while post(sys_url, "/engine/get_staged_weights", {"handle": h}
                       )["staged"][0]["state"] == "STAGING":
                time.sleep(0.2)
        t1 = time.monotonic()
        staged = [post(u, "/engine/get_staged_weights", {"handle": h})["staged"][0]
                  for u, h in zip(self.systems, handles, strict=True)]
        for u, h in zip(self.systems, handles, strict=True):
            post(u, "/engine/release_staged_weights", {"handle": h})
        time.sleep(max(5.0, t1 - t0))  # after: the same window with nothing staged
        t2 = time.monotonic()
        for s in streams:
            s.stop()
        during = sum(t0 <= t < t1 for s in streams for t in s.times) / (t1 - t0)
        after = sum(t1 + 1 <= t < t2 for s in streams for t in s.times) / (t2 - t1 - 1)
        self.out["stage_under_load_s"] = round(t1 - t0, 3)
        self.out["staged_under_load"] = [{k: x.get(k) for k in ("state", "prepared", "seconds",
                                                                 "prepare_seconds", "error")}
                                         for x in staged]
        self.out["base_tok_s"], self.out["base_tok_s_during_stage"] = after, during
        self.out["stream_tok_s"] = after / len(streams)
        print(f"tok/s: {after:.2f} without staging, {during:.2f} while both workers stage "
              f"({t1 - t0:.1f} s)", flush=True)

    def memory(self) -> None:
        """`--memory-refreshes` staged refreshes in a row (the default path: stage into the
        shadow while serving, then the commit's swap), alternating B and C: after each, the
        resident memory of every worker's process and of its engine core (its child), so
        that a copy of the weights kept per refresh shows as growth."""
        def sample() -> list[dict[str, float]]:
            time.sleep(2.0)  # the engine's thread lets the shadow go after the reply
            return [{"worker_gib": round(MemoryWatch.rss([w.popen.pid]) / 2**30, 3),
                     "engine_gib": round(MemoryWatch.rss(MemoryWatch.children(w.popen.pid))
                                         / 2**30, 3)} for w in self.fleet.workers]
        rows = [{"after": "start", "workers": sample()}]
        for i in range(self.args.memory_refreshes):
            ckpt = self.ckpts["B" if i % 2 == 0 else "C"]
            result, _ = self.refresh("vllm-staged", f"mem-{i + 1}", ckpt)
            rows.append({"after": f"refresh {i + 1}", "how": staged_how(result), "workers": sample(),
                         "stage_s": result.step_seconds().get("stage"),
                         "prepare_s": prepare_seconds(result)})
            print(f"memory after refresh {i + 1}: {rows[-1]}", flush=True)
        total = [sum(w["worker_gib"] + w["engine_gib"] for w in r["workers"]) for r in rows]
        self.out["memory_after_refresh"] = rows
        self.out["memory_workers_gib"] = [round(t, 3) for t in total]
        # the growth from the first staged refresh on (that one may still settle the
        # allocator's arenas), per refresh
        if len(total) > 2:
            self.out["memory_growth_per_refresh_gib"] = round(
                (total[-1] - total[1]) / (len(total) - 2), 3)
            # the builder's kept pages rise and are purged (a sawtooth): its top is the bound
            self.out["memory_max_after_refresh_gib"] = round(max(total[1:]), 3)

    def serving_gap(self) -> None:
        """Streams on every worker across a keep-mode refresh to B (stage first, then the
        commit): per worker the longest interval without a token, beside its swap. The
        streams start once the workers staged A (the coordinator waits for them to have
        `--gap-tokens` tokens each before its commit), so that what the swap costs them is
        measured on a known prefix: the prompt and those tokens, whose KV the engine
        computes again under the new weights before their next token."""
        n, k = self.args.streams, self.args.gap_tokens
        tokens = min(k + 64, self.args.max_model_len - len(PROMPT) - 1)
        streams: dict[str, list[Stream]] = {}

        def start_streams(msg: str) -> None:
            if streams or " stage done in " not in msg:
                return
            for i, u in enumerate(self.urls):
                streams[u] = [Stream(u, f"gap-{i}-{j}", tokens) for j in range(n)]
            for ss in streams.values():  # the coordinator's loop waits here: no commit yet
                for s in ss:
                    s.wait_tokens(k)
        self.events, self.on_events = [], [start_streams]
        old = post(self.systems[0], "/engine/get_weight_version")["version"]
        r0 = time.monotonic()
        try:
            result, secs = self.refresh("vllm-staged", "keep-B", self.ckpts["B"],
                                        pause_mode="keep")
        finally:
            self.on_events = []
        r1 = time.monotonic()
        for ss in streams.values():
            for s in ss:
                s.thread.join(1800)
        commit = next(t for t, m in self.events if " commit ... " in m)
        applies = commit_applies(result)
        system_of = dict(zip(self.urls, self.systems, strict=True))
        gaps = {u: serving_gap(ss, r0, r1) for u, ss in streams.items()}
        across = [s for ss in streams.values() for s in ss if s.times and s.times[0] < commit
                  and (len(s.times) < tokens or s.times[-1] > commit)]
        kept = [s for s in across if s.kept(old, "keep-B")]
        worst = max(gaps, key=gaps.get)
        # what the worst worker's gap holds: the keep-mode pause (the step in flight ends
        # and may still emit), the swap with the cache reset and the verify (nothing
        # emits), then, resumed (the resume step: until the self-check's token), the KV of
        # its frozen requests computed again under the new weights up to their next token
        steps = {s: commit_applies(result, (s,))[system_of[worst]]
                 for s in ("pause", "apply", "verify", "resume")}
        self.out.update({
            "gap_steps_s": {s: round(v, 3) for s, v in steps.items()},
            "gap_after_swap_s": gaps[worst] - steps["apply"] - steps["verify"],
            "gap_streams": n * len(self.urls), "gap_stream_tokens": tokens,
            "gap_tokens_before_swap": k,
            "serving_gap_s": {system_of[u]: round(g, 3) for u, g in gaps.items()},
            "swap_apply_s": {u: round(a, 3) for u, a in applies.items()},
            "serving_gap_worst_s": gaps[worst], "swap_apply_worst_s": applies[system_of[worst]],
            "keep_refresh_s": secs,
            "keep_steps_s": {k: round(v, 3) for k, v in result.step_seconds().items()},
            "inflight_across_swap": len(across), "inflight_kept_n": len(kept)})
        self.out["serving_gap_over_apply"] = gaps[worst] / applies[system_of[worst]]
        # the least a swap can cost a stream: the swap and the decode step it waits for
        # (the step in flight ends, or the first after the resume); where a decode step is
        # as long as the swap (a CPU), the key cannot reach its target however short the
        # rest of the window is: the floor beside it, and the gap less one step
        step = decode_step(streams[worst], commit)
        self.out["decode_step_s"] = round(step, 3)
        self.out["serving_gap_floor_over_apply"] = (applies[system_of[worst]] + step) / \
            applies[system_of[worst]]
        self.out["serving_gap_less_a_step_over_apply"] = (gaps[worst] - step) / \
            applies[system_of[worst]]
        self.out["inflight_kept"] = len(kept) / len(across) if across else 0.0
        for s in across:
            if s not in kept:
                print(f"  not kept: {s.finish} {len(s.times)}/{tokens} {s.error} {s.spans}")


@contextlib.contextmanager
def started_fleet(work: Path, ckpts: dict[str, Path], args: argparse.Namespace, s3: S3Server
                  ) -> Iterator[LocalFleet]:
    """A frontend that forwards control calls to the fleet control service, the service, and
    two vLLM workers (bf16, the modelexpress weight-transfer backend) started from A; all
    stopped on exit."""
    with LocalFleet(work / "fleet") as fleet:
        _start(fleet, work, ckpts, args, s3)
        yield fleet


def _start(fleet: LocalFleet, work: Path, ckpts: dict[str, Path], args: argparse.Namespace,
           s3: S3Server) -> None:
    port = free_port()
    fleet.start_frontend("--fleet-control", f"http://127.0.0.1:{port}", enable_rl=True)
    control = spawn("control", [sys.executable, "-m", "rlfleet.cli", "control", "--rl-url",
                                fleet.rl_url, "--model", MODEL, "--journal",
                                str(work / "control.sqlite"), "--port", str(port)],
                    work / "fleet" / "logs")
    fleet.procs.append(control)
    control.wait_ready(120)
    flags = ["--model", str(ckpts["A"]), "--served-model-name", MODEL, "--dtype", args.dtype,
             "--max-model-len", str(args.max_model_len), "--enforce-eager", "--enable-rl",
             "--system-port", "0", "--allowed-weights-root", str(work),
             "--allowed-weights-root", str(ckpts["A"].parent),
             "--weight-transfer-config", '{"backend": "modelexpress"}']
    # each on its share of the host's cores, as `rlfleet up` starts CPU workers (--no-pin:
    # every engine's OpenMP team spans every core, the environment's VLLM_CPU_OMP_THREADS_BIND)
    cores = [None] * args.workers if args.no_pin else worker_cores(args.workers)
    workers = [fleet.start_worker(*flags, wait=False, env=s3.env, cores=c) for c in cores]
    for w in workers:
        w.wait_ready(1800)


def run_phase(out: dict[str, Any], name: str, phase: Any) -> None:
    """Run one phase, timed; a failure is recorded under `errors` (and printed) instead of
    ending the run."""
    t0 = time.monotonic()
    try:
        phase()
    except Exception as e:  # noqa: BLE001 - recorded, the other phases still measure
        out.setdefault("errors", {})[name] = repr(e)[:2000]
        print(f"phase {name} FAILED: {e!r}", flush=True)
    out.setdefault("phase_s", {})[name] = round(time.monotonic() - t0, 1)
    print(f"phase {name}: {out['phase_s'][name]} s; so far: {json.dumps(out, default=str)}",
          flush=True)


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    """The five ratios (None where a phase they come from failed or was skipped). Publish to
    serving: the checkpoint's write, then the refresh until every worker serves the new
    policy (reopened, its self-check passed; the probe after it). The disk path's refresh
    against the bare reload: the whole refresh, probe included."""
    def ratio(a: str, b: str) -> float | None:
        return out[a] / out[b] if a in out and b in out else None

    if "disk_serving_s" in out:
        out["disk_end_to_end_s"] = out["save_s"] + out["disk_serving_s"]
    for key in ("staged", "staged_first"):
        if f"{key}_serving_s" in out:
            out[f"{key}_end_to_end_s"] = out["save_s"] + out[f"{key}_serving_s"]
    out.update({
        "refresh_over_bare_reload": ratio("disk_refresh_s", "bare_reload_s"),
        "staged_end_to_end_over_disk": ratio("staged_end_to_end_s", "disk_end_to_end_s"),
        "staged_first_end_to_end_over_disk": ratio("staged_first_end_to_end_s",
                                                   "disk_end_to_end_s"),
        "base_tok_s_during_stage_ratio": ratio("base_tok_s_during_stage", "base_tok_s")})
    out.setdefault("serving_gap_over_apply", None)
    out.setdefault("inflight_kept", None)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def checkpoints(root: Path, size: str, dtype: str) -> dict[str, Path]:
    """The checkpoints A, B, C (seeds 0, 1, 2) under `root/<size>-<dtype>`, made where
    missing."""
    out = {}
    for name, seed in (("A", 0), ("B", 1), ("C", 2)):
        path = root / f"{size}-{dtype}" / name
        if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
            make_model(path, size=size, seed=seed, dtype=dtype)
        out[name] = path
    return out


def warm_page_cache(ckpts: dict[str, Path]) -> float:
    """Read every checkpoint's files once, so that each path reads them from the page cache,
    as it reads a checkpoint the trainer has just written (the disk phase's B is read by the
    bare reloads before its measured refresh; the staged phase's C would otherwise be the
    first read of its files, from the disk). The seconds it took."""
    t0 = time.perf_counter()
    for path in ckpts.values():
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--streams", type=int, default=2, help="streams per worker")
    p.add_argument("--gap-tokens", type=int, default=16,
                   help="tokens each serving-gap stream has generated when the commit pauses it")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-pin", action="store_true",
                   help="leave the workers unpinned (every engine's OpenMP team on every core), "
                        "not each on its share of the cores as `rlfleet up` starts them")
    p.add_argument("--skip", default="",
                   help="comma-separated phases: disk,staged,tok/s,gap,delta,four-phase")
    p.add_argument("--checkpoints", default="",
                   help="a directory to keep the three checkpoints in (made there once, "
                        "reused: make_model writes the same bytes for a size, seed and dtype)")
    p.add_argument("--memory-refreshes", type=int, default=0,
                   help="then N staged refreshes in a row, the workers' and engines' resident "
                        "memory after each (memory_after_refresh); 0: not measured")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(tempfile.mkdtemp(prefix="rlfleet-bench-refresh-"))
    out: dict[str, Any] = {"size": args.size, "dtype": args.dtype, "workers": args.workers,
                           "pinned": not args.no_pin}
    try:
        ckpts = checkpoints(Path(args.checkpoints) if args.checkpoints else work / "ckpt",
                            args.size, args.dtype)
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpts["A"].glob("*.safetensors"))
        out["save_s"] = save_seconds(ckpts["A"], work / "saved")
        out["page_cache_warm_s"] = warm_page_cache(ckpts)
        with S3Server() as s3, started_fleet(work, ckpts, args, s3) as fleet:
            b = Bench(args, work, fleet, ckpts, s3)
            b.out = out
            watch = MemoryWatch([w.popen.pid for w in fleet.workers])
            try:
                # the five ratios' phases first; a phase that fails is recorded and the run
                # goes on (a path's failure is a figure too), the fleet as it left it
                for name, phase in (("disk", b.disk_and_bare), ("staged", b.staged),
                                    ("tok/s", b.tokens_per_s_while_staging),
                                    ("gap", b.serving_gap), ("delta", b.delta),
                                    ("four-phase", b.four_phase), ("memory", b.memory)):
                    if name not in skip and (name != "memory" or args.memory_refreshes):
                        watch.phase = name
                        run_phase(out, name, phase)
            finally:
                out["memory_peaks"] = watch.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = ratios(out)
    print(f"\n{args.size} geometry, {args.dtype}, {args.workers} workers "
          f"({out['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint)")
    for k in ("serving_gap_over_apply", "refresh_over_bare_reload",
              "staged_end_to_end_over_disk", "base_tok_s_during_stage_ratio", "inflight_kept",
              "serving_gap_floor_over_apply", "serving_gap_less_a_step_over_apply"):
        print(f"  {k:<36} {out.get(k)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
