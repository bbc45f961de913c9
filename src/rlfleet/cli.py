"""The `rlfleet` command: one subcommand per user task."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _make_model(args: argparse.Namespace) -> int:
    from rlfleet.models import make_model

    out = make_model(Path(args.out), size=args.size, seed=args.seed, dtype=args.dtype)
    print(out)
    return 0


def _digest(args: argparse.Namespace) -> int:
    from rlfleet.weights.digest import checkpoint_digest

    print(checkpoint_digest(Path(args.path)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rlfleet.demo import DemoConfig, run_demo

    cfg = DemoConfig(out=Path(args.out), steps=args.steps, prompts=args.prompts,
                     group_size=args.group_size, lr=args.lr, warmup_steps=args.warmup_steps,
                     seed=args.seed, check_learning=not args.no_learning_check)
    try:
        report = run_demo(cfg)
    except KeyboardInterrupt:
        print("\nrlfleet demo: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    out = Path(args.out).resolve()
    print(f"first step reward {report['first_step_reward']}, last-3 mean "
          f"{report['last3_mean_reward']}, max logprob diff {report['max_abs_logprob_diff']}, "
          f"total {report['total_seconds']:.0f} s")
    print(f"report: {out / 'report.json'}" + (f", plot: {out / 'report.png'}"
                                               if (out / "report.png").exists() else ""))
    if not report["ok"]:
        for f in report["failures"]:
            print(f"rlfleet demo: FAILED: {f}", file=sys.stderr)
        return 1
    print("rlfleet demo: all checks passed")
    return 0


def _publish(args: argparse.Namespace) -> int:
    import json

    import torch

    from rlfleet.weights.artifacts import ArtifactError
    from rlfleet.weights.catalog import CatalogError
    from rlfleet.weights.publish import publish

    try:
        res = publish(Path(args.checkpoint), args.version, to=args.to, base=args.base,
                      catalog=args.catalog, model=args.model, endpoint_url=args.s3_endpoint_url,
                      dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (ArtifactError, CatalogError) as e:
        print(f"rlfleet publish: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: res[k] for k in ("version", "base_version", "digest", "bytes_full",
                                          "bytes_written")}))
    return 0


def default_journal() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return Path(os.environ.get("RLFLEET_JOURNAL", base / "rlfleet" / "journal.sqlite"))


def _refresh(args: argparse.Namespace) -> int:
    import asyncio

    from rlfleet.rl.refresh import PolicyRefresh, SglangWorker

    sglang = [SglangWorker(*pair.split(",", 1)) for pair in args.sglang_worker]
    source = None
    if args.staged:
        from rlfleet.rl.staged import source_from_uri

        if not (args.source or args.checkpoint):
            raise ValueError("--staged needs --source (s3://bucket/prefix/VERSION, a version "
                             "directory, or a trainer's http://host:port) or --checkpoint")
        source = source_from_uri(args.source, args.s3_endpoint_url) if args.source else None
    elif not args.checkpoint:
        raise ValueError("--checkpoint is required (or --staged --source URI)")
    coordinator = PolicyRefresh(
        args.rl_url, model=args.model, path="vllm-staged" if args.staged else args.path,
        sglang_workers=sglang,
        journal=args.journal, on_failure=args.on_failure, retries=args.retries,
        pause_mode=args.pause_mode, probe_tolerance=args.probe_tolerance,
        admin_token=args.admin_token, on_event=lambda msg: print(msg, flush=True))
    result = asyncio.run(coordinator.refresh(args.checkpoint, args.version, digest=args.digest,
                                             step=args.step, source=source))
    print(f"decision: {result.decision} ({result.reason})")
    for s in result.steps:
        print(f"  {s['name']:<12} {s['seconds']:8.3f} s")
    for w in result.workers:
        print(f"  worker {w['instance_id']}: {w['status']}" + (f" ({w['reason']})" if w["reason"] else ""))
    print(f"journal: {args.journal} (refresh {result.refresh_id})")
    return 0 if result.ok else 1


def _journal(args: argparse.Namespace) -> int:
    import json
    import time

    from rlfleet.rl.journal import Journal

    if not Path(args.journal).exists():
        print(f"no journal at {args.journal}")
        return 0
    for r in Journal(args.journal).recent(args.limit):
        if args.json:
            print(json.dumps(r))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))
        total = sum(s["seconds"] for s in r["steps"] or [])
        print(f"#{r['id']} {when} step={r['framework_step']} {r['update_path']} "
              f"{r['previous_version']} -> {r['target_version']} [{r['decision']}] "
              f"{total:.2f}s: {r['reason']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random Qwen3-architecture test checkpoint")
    mm.add_argument("out", help="output directory")
    mm.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    mm.set_defaults(func=_make_model)

    dg = sub.add_parser("digest", help="print the content digest of a checkpoint directory")
    dg.add_argument("path")
    dg.set_defaults(func=_digest)

    pb = sub.add_parser("publish", help="publish a checkpoint as a policy version (full or an "
                                         "XOR delta) to a directory or S3, READY in the catalog")
    pb.add_argument("checkpoint", help="checkpoint directory (safetensors)")
    pb.add_argument("--version", required=True, help="the version's name")
    pb.add_argument("--base", default=None,
                    help="publish an XOR delta against this version (read from --to)")
    pb.add_argument("--to", required=True, help="file:///dir or s3://bucket/prefix; the version "
                                               "is written under <to>/<version>/")
    pb.add_argument("--s3-endpoint-url", default=None,
                    help="S3 endpoint (default: boto3's own, e.g. $AWS_ENDPOINT_URL)")
    pb.add_argument("--catalog", default=os.environ.get("RLFLEET_WEIGHTS_CATALOG"),
                    help="version catalog: sqlite:///path or etcd://host:port "
                         "(default: $RLFLEET_WEIGHTS_CATALOG; none: not registered)")
    pb.add_argument("--model", default=None, help="model name in the catalog "
                                                  "(default: the checkpoint directory's name)")
    pb.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="cast floating-point tensors before publishing")
    pb.set_defaults(func=_publish)

    rf = sub.add_parser("refresh", help="move a fleet to a checkpoint (policy refresh)")
    rf.add_argument("--checkpoint", default=None,
                    help="checkpoint directory the workers can read (required unless --staged "
                         "--source)")
    rf.add_argument("--version", required=True, help="the version to declare")
    rf.add_argument("--digest", default=None, help="target digest (default: computed from the checkpoint)")
    rf.add_argument("--rl-url", default=os.environ.get("RLFLEET_RL_URL", "http://127.0.0.1:8001"),
                    help="the frontend's RL listener")
    rf.add_argument("--model", default=None, help="only workers serving this model")
    rf.add_argument("--path", default="vllm-disk", choices=["vllm-disk", "vllm-distributed", "sglang-disk"])
    rf.add_argument("--sglang-worker", action="append", default=[], metavar="SYSTEM_URL,REQUEST_URL")
    rf.add_argument("--staged", action="store_true",
                    help="workers pull the version while they serve (stage_weights); the fleet "
                         "is gated only to install it")
    rf.add_argument("--source", default=None,
                    help="with --staged: s3://bucket/prefix/VERSION, a version directory, or a "
                         "trainer publisher's http://host:port")
    rf.add_argument("--s3-endpoint-url", default=None, help="S3 endpoint of --source "
                                                            "(default: boto3's own)")
    rf.add_argument("--on-failure", default="hold", choices=["retry", "rollback", "hold"])
    rf.add_argument("--retries", type=int, default=1)
    rf.add_argument("--pause-mode", default="wait", choices=["keep", "wait", "abort"])
    rf.add_argument("--probe-tolerance", type=float, default=1e-3)
    rf.add_argument("--admin-token", default=os.environ.get("RLFLEET_ADMIN_TOKEN"))
    rf.add_argument("--step", type=int, default=None, help="framework step, for the journal")
    rf.add_argument("--journal", default=str(default_journal()))
    rf.set_defaults(func=_refresh)

    jn = sub.add_parser("journal", help="show past policy refreshes")
    jn.add_argument("--journal", default=str(default_journal()))
    jn.add_argument("--limit", type=int, default=20)
    jn.add_argument("--json", action="store_true")
    jn.set_defaults(func=_journal)

    de = sub.add_parser("demo", help="GRPO training on a local fleet of two vLLM workers")
    de.add_argument("--out", default="rlfleet-demo",
                    help="output directory (the demo's earlier files there are replaced)")
    de.add_argument("--steps", type=int, default=10, help="training steps")
    de.add_argument("--prompts", type=int, default=4, help="prompts (groups) per step")
    de.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    de.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate of the GRPO steps")
    de.add_argument("--warmup-steps", type=int, default=30, help="supervised warm-up steps")
    de.add_argument("--seed", type=int, default=0)
    de.add_argument("--no-learning-check", action="store_true",
                    help="do not require the reward to improve (for short runs)")
    de.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError) as e:
        print(f"rlfleet {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
