"""The weight plane on the Qwen3-0.6B geometry in bfloat16, with real RL training steps:
the demo's trainer (GrpoTrainer, float32 master weights) takes AdamW steps at lr 1e-6 and
each step is published as bf16, full first, then as exact-base XOR deltas.

    python bench/weights.py [--steps 3] [--size small]

Per step it prints: delta bytes ÷ full bytes; delta encode and decode GB/s beside a plain
copy of the same bytes (measured in the same run); and, on a fleet of two vLLM workers (one
refreshed through the staged path, one through update_weights_from_disk, same versions),
stage time, apply time, and the gated window of the staged refresh ÷ the unstaged one.
Aims: delta ≤ 0.05 of full; gated window ≤ 0.3 of the unstaged one; encode and decode
within 3× of the plain copy.

The reward of the GRPO steps is the fraction of even token IDs in a completion (a random
0.6B model never writes the demo's "7"s, so its reward would be flat and the gradient zero)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rlfleet.models import make_model
from rlfleet.refresh.coordinator import PolicyRefresh, reference_probe
from rlfleet.testing.fleet import LocalFleet
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout
from rlfleet.weights import artifacts as art
from rlfleet.weights.publish import Publisher, prepare_tensors

PROMPTS = [[151644, 872, 198, 15 + i, 16 + i, 151645, 198, 151644, 77091, 198] for i in range(2)]
GROUP, TOKENS = 4, 8


def rollouts(trainer: GrpoTrainer, seed: int) -> list[Rollout]:
    """GROUP samples per prompt at temperature 1 from the trainer's own policy; their
    logprobs are the behaviour policy (the trainer's, as an on-policy engine would give)."""
    torch.manual_seed(seed)
    model = trainer.model
    out = []
    with torch.no_grad():
        for g, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt] * GROUP)
            for _ in range(TOKENS):
                logits = model(ids).logits[:, -1].float()
                nxt = torch.multinomial(torch.softmax(logits, -1), 1)
                ids = torch.cat([ids, nxt], 1)
            comps = [row[len(prompt):].tolist() for row in ids]
            lps = trainer.completion_logprobs([prompt] * GROUP, comps)
            for c, lp in zip(comps, lps, strict=True):
                out.append(Rollout(g, prompt, c, lp.tolist(), sum(t % 2 == 0 for t in c) / len(c)))
    return out


def scratch_like(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Preallocated, touched buffers (no page faults inside a timing)."""
    out = {n: np.empty_like(a) for n, a in tensors.items()}
    for a in out.values():
        a[:] = 0
    return out


def plain_copy_gbps(tensors: dict[str, torch.Tensor], dst: dict[str, np.ndarray]) -> float:
    """A copy of the same bytes into preallocated buffers (the baseline)."""
    src = {n: art.tensor_bytes(t) for n, t in tensors.items()}
    t0 = time.perf_counter()
    for n in src:
        np.copyto(dst[n], src[n])
    return sum(a.nbytes for a in src.values()) / (time.perf_counter() - t0) / 1e9


def decode_gbps(artifact: art.Artifact, base: dict[str, np.ndarray],
                out: dict[str, np.ndarray]) -> float:
    """Decode a delta (from its encoded bytes in memory) onto the base into preallocated
    buffers, every target checked (Adler-32), one tensor per core, as staging does."""
    frames: dict[str, tuple[np.ndarray, str]] = {}
    for _, data in artifact.files:
        header, start = art.parse_header(data, "delta")
        sums = header.pop("__metadata__")
        for n, info in header.items():
            b, e = info["data_offsets"]
            frames[n] = (np.frombuffer(data, np.uint8, e - b, start + b), sums[n])
    t0 = time.perf_counter()
    for n, b in base.items():
        if n not in frames:
            np.copyto(out[n], b)
    art.decode_deltas((n, frames[n][0], b, out[n], frames[n][1]) for n, b in base.items()
                      if n in frames)
    return sum(a.nbytes for a in base.values()) / (time.perf_counter() - t0) / 1e9


def window(result) -> float:
    """Seconds the fleet was gated: every lifecycle step but staging."""
    return sum(s["seconds"] for s in result.steps if s["name"] != "stage")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=3, help="training steps (each one a delta)")
    p.add_argument("--lr", type=float, default=1e-6)
    args = p.parse_args()
    torch.set_num_threads(2)
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="rlfleet-bench-weights-"))
    store = Path(tempfile.mkdtemp(prefix="rlfleet-bench-versions-", dir=shm))
    rows = []
    try:
        base = make_model(work / "base", size=args.size, dtype="bfloat16")
        # 1. training: AdamW steps on float32 master weights, each published as a bf16 delta
        # (the trainer is freed before the fleet starts: both at once do not fit in 24 GiB)
        trainer = GrpoTrainer(base, lr=args.lr, seed=0)
        trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=args.lr)
        pub = Publisher(f"file://{store}", model="bench", dtype=torch.bfloat16)
        versions = []

        def publish(step: int) -> None:
            state = prepare_tensors(trainer.state_dict(), torch.bfloat16)
            v = f"step-{step}"
            res = pub.publish(state, v, base=None if step == 0 else f"step-{step - 1}")
            versions.append((v, res, save_checkpoint(state, base, work / v)))

        publish(0)
        scratch = scratch_like(pub.last[1])
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            stats = trainer.step(rollouts(trainer, step))
            trainer.optimizer.zero_grad(set_to_none=True)
            train_s = time.perf_counter() - t0
            prev = pub.last[1]
            cur = prepare_tensors(trainer.state_dict(), torch.bfloat16)
            t0 = time.perf_counter()
            artifact = art.encode_delta(f"step-{step}", f"step-{step - 1}", cur, prev, "-")
            encode_s = time.perf_counter() - t0
            full = artifact.bytes_full
            rows.append({
                "step": step, "train_s": round(train_s, 1), "loss": round(stats.loss, 4),
                "changed_tensors": artifact.changed, "tensors": len(cur),
                "delta_bytes": artifact.bytes_written, "full_bytes": full,
                "delta_ratio": artifact.bytes_written / full,
                "changed_elements": sum(
                    int(np.count_nonzero(art.tensor_bytes(cur[n]).view(np.uint16)
                                         != prev[n].view(np.uint16))) for n in cur) / (full / 2),
                "encode_gbps": full / encode_s / 1e9,
                "decode_gbps": decode_gbps(artifact, prev, scratch),
                "copy_gbps": plain_copy_gbps(cur, scratch)})
            del artifact, cur
            publish(step)
        trainer = pub = scratch = None  # free the master weights and optimizer state
        gc.collect()
        # 2. the fleet: one worker refreshed through the staged path, one from disk
        flags = ["--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager",
                 "--enable-rl", "--system-port", "0", "--allowed-weights-root", str(work),
                 "--allowed-weights-root", str(store), "--no-warmup"]
        with LocalFleet(work / "fleet") as fleet:
            fleet.start_frontend(enable_rl=True)
            procs = [fleet.start_worker("--model", str(base), "--served-model-name", name, *flags,
                                        wait=False) for name in ("staged", "disk")]
            for proc in procs:
                proc.wait_ready(1200)
            kw = {"probe_tokens": 4, "probe_tolerance": 5e-2,
                  "timeout": 600}
            staged = PolicyRefresh(fleet.rl_url, model="staged", path="vllm-staged", **kw)
            disk = PolicyRefresh(fleet.rl_url, model="disk", **kw)

            async def refresh(v: str, res: dict, ckpt: Path) -> tuple:
                probe = await asyncio.to_thread(reference_probe, ckpt, PROMPTS[0], 4)
                s = await staged.refresh(None, v, digest=res["digest"], probe=probe,
                                         source={"kind": "disk", "path": str(store / v)})
                d = await disk.refresh(ckpt, v, digest=res["digest"], probe=probe)
                assert s.ok and d.ok, (s.reason, d.reason)
                return s, d

            asyncio.run(refresh(*versions[0]))  # step 0: full, both paths
            for row, (v, res, ckpt) in zip(rows, versions[1:], strict=True):
                s, d = asyncio.run(refresh(v, res, ckpt))
                ss, ds = s.step_seconds(), d.step_seconds()
                row.update({"stage_s": ss["stage"], "apply_staged_s": ss["apply"],
                            "apply_disk_s": ds["apply"], "window_staged_s": window(s),
                            "window_disk_s": window(d),
                            "steps_staged": {k: round(x, 3) for k, x in ss.items()},
                            "steps_disk": {k: round(x, 3) for k, x in ds.items()}})
                row["window_ratio"] = row["window_staged_s"] / row["window_disk_s"]
                print(json.dumps({k: round(x, 4) if isinstance(x, float) else x
                                  for k, x in row.items()}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    print(f"\n{args.size} geometry, bf16, {len(rows)} AdamW steps at lr {args.lr} (medians):")
    print(f"  delta / full bytes        {med('delta_ratio'):.4f}   (aim ≤ 0.05; "
          f"{med('changed_elements'):.2%} of bf16 elements changed)")
    print(f"  encode / decode / copy    {med('encode_gbps'):.2f} / {med('decode_gbps'):.2f} / "
          f"{med('copy_gbps'):.2f} GB/s   (copy ÷ encode {med('copy_gbps') / med('encode_gbps'):.2f}, "
          f"copy ÷ decode {med('copy_gbps') / med('decode_gbps'):.2f}; aim ≤ 3)")
    print(f"  stage (while serving)     {med('stage_s'):.3f} s")
    print(f"  apply staged / from disk  {med('apply_staged_s'):.3f} / {med('apply_disk_s'):.3f} s")
    print(f"  gated window staged / disk {med('window_staged_s'):.3f} / {med('window_disk_s'):.3f} s"
          f" = {med('window_ratio'):.3f}   (aim ≤ 0.3)")


if __name__ == "__main__":
    main()
