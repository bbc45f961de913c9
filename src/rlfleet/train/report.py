"""The demo's record: `report.json` (every step, the fleet, the checks) and `report.png`
(reward, refresh time and trainer/engine logprob mismatch per step; for the asynchronous
loop also each sample's staleness and the trainer's and the fleet's idle fractions)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(report: dict[str, Any], path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def plot(report: dict[str, Any], path: Path) -> Path:
    """Three panels over the training steps; the limits the demo checks are drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    x = [s["step"] for s in steps]
    stream = report.get("stream")
    fig, axes = plt.subplots(1, 4 if stream else 3, figsize=(20 if stream else 15, 4.2))
    ax_r, ax_t, ax_d = axes[:3]
    if stream:
        staleness_panel(axes[3], steps, stream, report["config"].get("max_staleness"))

    ax_r.plot(x, [s["mean_reward"] for s in steps], "o-", label="rollouts of the step")
    final = report.get("final_eval")
    if final:
        ax_r.plot([final["step"]], [final["mean_reward"]], "s", color="C2",
                  label=f"final policy ({final['policy_version']})")
    ax_r.axhline(report["task"]["chance_reward"], ls=":", color="grey", label="chance")
    ax_r.set(title="mean reward (fraction of '7' tokens)", xlabel="step", ylim=(0, 1))
    ax_r.legend(loc="upper left", fontsize=8)

    phases = sorted({name for s in steps for name in s["refresh_phase_seconds"]},
                    key=lambda n: [p for s in steps for p in s["refresh_phase_seconds"]].index(n))
    bottom = [0.0] * len(steps)
    for i, name in enumerate(phases):
        h = [s["refresh_phase_seconds"].get(name, 0.0) for s in steps]
        ax_t.bar(x, h, bottom=bottom, label=name, color=f"C{i % 10}")
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ax_t.plot(x, [s["refresh_seconds"] for s in steps], "k.-", label="wall (whole refresh)")
    ax_t.set(title=f"policy refresh of {len(report['fleet']['workers'])} workers",
             xlabel="step (refresh to step-N)", ylabel="seconds")
    top = max([*bottom, *(s["refresh_seconds"] for s in steps)], default=1.0)
    ax_t.set_ylim(0, top * 1.6)  # room for the legend
    ax_t.legend(fontsize=7, ncol=3, loc="upper center")

    ax_d.semilogy(x, [s["max_abs_logprob_diff"] for s in steps], "o-", label="max |Δ|")
    ax_d.semilogy(x, [s["mean_abs_logprob_diff"] for s in steps], "o-", label="mean |Δ|")
    ax_d.axhline(report["checks"]["max_logprob_diff_limit"], ls="--", color="red", label="limit")
    ax_d.set(title="logprob mismatch: trainer vs engine", xlabel="step")
    ax_d.legend(fontsize=8)

    ax_r.set_xticks(x + ([final["step"]] if final else []),
                    [str(i) for i in x] + (["final"] if final else []))
    for ax in (ax_t, ax_d):
        ax.set_xticks(x)
    for ax in (ax_r, ax_t, ax_d):
        ax.grid(alpha=0.3)
    fig.suptitle(f"rlfleet demo{' --async' if stream else ''}: GRPO on {report['fleet']['model']} "
                 f"({report['config']['prompts']} prompts × {report['config']['group_size']} "
                 f"samples per step), total {report['total_seconds']:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def staleness_panel(ax: Any, steps: list[dict[str, Any]], stream: dict[str, Any],
                    bound: int | None) -> None:
    """Each trained sample's staleness (steps its oldest token lags the trainer), by step;
    the idle fractions in the title."""
    from collections import Counter

    for s in steps:
        for st, n in Counter(s["sample_staleness"]).items():
            ax.scatter([s["step"]], [st], s=30 + 25 * n, color="C0", alpha=0.7)
            ax.annotate(str(n), (s["step"], st), fontsize=7, ha="center", va="center")
    if bound is not None:
        ax.axhline(bound, ls="--", color="red", label=f"max_staleness {bound}")
        ax.legend(fontsize=8, loc="upper left")
    ax.set(title=f"sample staleness (count); idle: trainer "
                 f"{stream['trainer_idle_fraction']:.0%}, fleet {stream['fleet_idle_fraction']:.0%}",
           xlabel="step", ylabel="steps behind the trainer")
    ax.set_ylim(-0.5, (bound or 1) + 1)
    ax.set_xticks([s["step"] for s in steps])
    ax.grid(alpha=0.3)
