"""The `rlfleet` command: one subcommand per user task."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.refresh.control import DEFAULT_CONCURRENCY
from rlfleet.refresh.relay import DEFAULT_THRESHOLD as RELAY_THRESHOLD
from rlfleet.runtime.flags import Flag, add_flags
from rlfleet.runtime.logs import add_log_args, setup_logging

if TYPE_CHECKING:
    from rlfleet.refresh.coordinator import PolicyRefresh
    from rlfleet.refresh.hooks import RefreshHooks


def _make_model(args: argparse.Namespace) -> int:
    from rlfleet.models import make_adapter, make_model

    if args.adapter:
        out = make_adapter(Path(args.out), size=args.size, rank=args.rank, seed=args.seed,
                           dtype=args.dtype)
    else:
        out = make_model(Path(args.out), size=args.size, seed=args.seed, dtype=args.dtype,
                         arch=args.arch)
    print(out)
    return 0


def _digest(args: argparse.Namespace) -> int:
    from rlfleet.weights.digest import checkpoint_digest

    print(checkpoint_digest(Path(args.path)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rlfleet.demo import DemoConfig, run_demo
    from rlfleet.demo_async import train_async

    cfg = DemoConfig(out=Path(args.out), steps=args.steps, prompts=args.prompts,
                     group_size=args.group_size, lr=args.lr, warmup_steps=args.warmup_steps,
                     seed=args.seed, check_learning=not args.no_learning_check,
                     asynchronous=args.asynchronous, max_staleness=args.max_staleness)
    try:
        report = run_demo(cfg, train_async if args.asynchronous else None)
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
    from rlfleet.weights.retention import Retention

    retention = None
    if args.retain_versions is not None:
        if not args.catalog:
            raise ValueError("--retain-versions needs --catalog: retention releases and evicts "
                             "the versions the catalog lists")
        retention = Retention(args.retain_versions)
    try:
        res = publish(Path(args.checkpoint), args.version, to=args.to, base=args.base,
                      catalog=args.catalog, model=args.model, endpoint_url=args.s3_endpoint_url,
                      dtype=getattr(torch, args.dtype) if args.dtype else None,
                      retention=retention, pins=lambda: _in_use(args.journal)[0],
                      workers=lambda: _in_use(args.journal)[1])
    except (ArtifactError, CatalogError) as e:
        print(f"rlfleet publish: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: res[k] for k in ("version", "base_version", "digest", "bytes_full",
                                          "bytes_written", "retention") if k in res}))
    return 0


def _in_use(journal_url: str | None) -> tuple[dict[str, str], frozenset[str] | None]:
    """What the refresh journal at `journal_url` says is in use: the versions
    (rlfleet.weights.retention.journal_pins) and the workers (journal_workers); nothing, and
    any worker, without one."""
    from rlfleet.journal import JournalMissing, open_journal
    from rlfleet.weights.retention import journal_pins, journal_workers

    if not journal_url:
        return {}, None
    try:
        journal = open_journal(journal_url, create=False)
    except JournalMissing:
        return {}, None
    with journal:
        return journal_pins(journal), journal_workers(journal)


def _weights_gc(args: argparse.Namespace) -> int:
    """`rlfleet weights gc`: one retention collection over the catalog; its report."""
    import asyncio
    import json

    from rlfleet.weights.retention import Retention, collect_url

    policy = Retention(args.retain_versions, args.tombstones)
    pins, workers = _in_use(args.journal)
    report = asyncio.run(collect_url(args.catalog, policy, pins=pins, workers=workers,
                                     dry_run=args.dry_run, endpoint_url=args.s3_endpoint_url))
    print(json.dumps(report))
    return 0


def _weights_list(args: argparse.Namespace) -> int:
    """`rlfleet weights list`: every version in the catalog, its state and why."""
    import asyncio
    import json

    from rlfleet.weights.catalog import Catalog

    async def listing() -> list:
        async with Catalog(args.catalog) as cat:
            return await cat.list(args.model)
    for v in sorted(asyncio.run(listing()), key=lambda v: (v.created_at, v.version)):
        if args.json:
            print(json.dumps(v.to_json()))
            continue
        base = f" on {v.base_version}" if v.base_version else ""
        why = f" ({v.release_reason})" if v.release_reason else ""
        users = [f"{len(v.live_leases())} lease(s)"] if v.live_leases() else []
        users += [f"held by {', '.join(sorted(v.holders))}"] if v.holders else []
        print(f"{v.version:<24} {v.state.value:<9} {v.format.value}{base}"
              f"{' [' + '; '.join(users) + ']' if users else ''}{why}")
    return 0


def default_journal() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return Path(os.environ.get("RLFLEET_JOURNAL", base / "rlfleet" / "journal.sqlite"))


def coordinator(args: argparse.Namespace, hooks: RefreshHooks | None = None) -> PolicyRefresh:
    """The coordinator `rlfleet refresh` / `rlfleet recover` run (`hooks`: tests only)."""
    from rlfleet.refresh.config import RefreshConfig
    from rlfleet.refresh.coordinator import PolicyRefresh
    from rlfleet.refresh.hooks import NO_HOOKS

    return PolicyRefresh(config=RefreshConfig.from_args(args), hooks=hooks or NO_HOOKS,
                         on_event=lambda msg: print(msg, flush=True))


def _report(result, journal: str) -> int:
    """Print how a transaction ended; the exit status: 0 reopened on its target, 1 not
    (held, rolled back), 3 fenced (another coordinator owns the fleet)."""
    print(f"decision: {result.decision} ({result.reason})")
    for s in result.steps:
        wave = f" (wave {s['wave']})" if s.get("wave") else ""
        print(f"  {s['name'] + wave:<20} {s['seconds']:8.3f} s")
    for w in result.workers:
        print(f"  worker {w['instance_id']}: {w['status']}" + (f" ({w['reason']})" if w["reason"] else ""))
    print(f"journal: {journal} (refresh {result.refresh_id}, fleet epoch {result.epoch})")
    if result.decision == "fenced":
        print(f"rlfleet: this coordinator was fenced: {result.reason}", file=sys.stderr)
        return 3
    return 0 if result.ok else 1


def run_refresh(args: argparse.Namespace, hooks: RefreshHooks | None = None) -> int:
    """`rlfleet refresh` (`hooks`: tests only, see tests/refresh_hooked.py)."""
    import asyncio

    source = None
    if args.source:
        from rlfleet.refresh.staged import source_from_uri

        if not (args.staged or args.path in ("vllm-staged", "vllm-adapter")):
            raise ValueError(f"--source is for --path vllm-staged or vllm-adapter, not "
                             f"{args.path}")
        source = source_from_uri(args.source, args.s3_endpoint_url)
    elif not args.checkpoint:
        raise ValueError("--checkpoint is required (or --source URI)")
    result = asyncio.run(coordinator(args, hooks).refresh(
        args.checkpoint, args.version, digest=args.digest, step=args.step, source=source))
    return _report(result, args.journal)


def _recover(args: argparse.Namespace) -> int:
    import asyncio

    result = asyncio.run(coordinator(args).recover())
    if result is None:
        print(f"nothing to recover: every transaction in {args.journal} finished")
        return 0
    return _report(result, args.journal)


def _journal(args: argparse.Namespace) -> int:
    import json
    import time

    from rlfleet.journal import JournalMissing, open_journal

    try:
        journal = open_journal(args.journal, create=False)
    except JournalMissing:
        print(f"no journal at {args.journal}")
        return 0
    with journal:
        rows = journal.recent(args.limit)
        history = journal.history()
    for r in rows:
        if args.json:
            print(json.dumps(r))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))
        total = sum(s["seconds"] for s in r["steps"] or [])
        serves = f" serves {r.served.version}" if r.served.version else ""
        kind = f" {r['kind']}" if r.get("kind") not in (None, "refresh") else ""
        state = f" after {r['state']}" if r.get("state") and not r.get("decision") else ""
        summary = " (summary)" if r.get("compacted") else ""
        print(f"#{r['id']} {when} epoch={r.get('fleet_epoch')} step={r['framework_step']}"
              f"{kind} {r['update_path']} {r.previous.version} -> {r.target.version} "
              f"[{r['decision'] or 'unfinished'}{state}]{serves} {total:.2f}s{summary}: "
              f"{r['reason']}")
    if not args.json and (any(r.get("compacted") for r in rows) or history):
        print(_journal_bounds(journal, history))
    return 0


def _journal_bounds(journal, history: list[dict]) -> str:
    """What `rlfleet journal` says of a journal's compaction (rlfleet.journal.base)."""
    folded = sum(h["transactions"] for h in history)
    lines = [f"journal {journal.path}: the newest transactions (and any unfinished) are kept "
             "whole, older ones as summaries (decision, policies, times; the workers' calls "
             f"and steps dropped: marked (summary)); {folded} older folded into the history:"]
    for h in history:
        counts = ", ".join(f"{d} {n}" for d, n in sorted(h["decisions"].items()))
        lines.append(f"  fleet {h['fleet']} model {h['model']}: {h['transactions']} "
                     f"transaction(s) #{h['first_id']}-#{h['last_id']} ({counts})")
    return "\n".join(lines)


def _print_members(members: list[dict]) -> None:
    for m in members:
        ready = m.get("ready") or {}
        where = ready.get("url", "")
        extra = f" rl_url={ready['rl_url']}" if ready.get("rl_url") else ""
        extra += f" system_url={ready['system_url']}" if ready.get("system_url") else ""
        alive = "" if m.get("alive", True) else " [not running]"
        again = " (restarted by Ray)" if m.get("restarted") else ""
        print(f"  {m['name']:<10} pid {m.get('pid', '?'):<8} {where}{extra}{alive}{again}")


def _up(args: argparse.Namespace) -> int:
    import yaml

    from rlfleet.runtime.launch import FleetSpec, up_local, write_state

    config = None
    if args.config:
        config = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{args.config}: a fleet config is a mapping (discovery, "
                             "namespace, frontend, workers, control)")
    worker_args = list(args.worker_args)
    if worker_args[:1] == ["--"]:
        worker_args = worker_args[1:]
    state_dir = Path(args.state)
    spec = FleetSpec.load(config, state_dir=state_dir, discovery=args.discovery,
                          kind=args.kind, count=args.workers, worker_args=worker_args,
                          admin_token_file=args.admin_token_file,
                          frontend_processes=args.processes)
    if args.ray:
        from rlfleet.runtime.launch import read_state
        from rlfleet.runtime.placement import up_ray

        if spec.control is not None:
            raise ValueError("fleet config: control: is started by `rlfleet up` without --ray "
                             "only; with --ray, run `rlfleet control --rl-url ...` beside the "
                             "fleet and give the frontend fleet-control: its URL")

        if read_state(state_dir) is not None:
            raise ValueError(f"a fleet is already up from {state_dir}: `rlfleet down` first")
        if spec.discovery.startswith("file://"):
            print("rlfleet up: file discovery works only while every member runs on this "
                  "node; a multi-node cluster needs --discovery etcd://HOST:PORT",
                  file=sys.stderr)
        state = up_ray(spec, args.ray, state_dir, namespace=args.ray_namespace,
                       timeout=args.timeout)
        write_state(state_dir, state)
    else:
        state = up_local(spec, state_dir, timeout=args.timeout)
    front = state["members"][0].get("ready", {})
    print(f"rlfleet up: {len(spec.workers)} worker(s), discovery {spec.discovery}"
          + (f", Ray {args.ray} (namespace {args.ray_namespace})" if args.ray else ""))
    print(f"frontend: {front.get('url')}" + (f"  RL listener: {front['rl_url']}"
                                             if front.get("rl_url") else ""))
    if spec.control_url:
        journal = next((m["ready"].get("journal") for m in state["members"]
                        if m["name"] == "control"), None)
        print(f"fleet control: {spec.control_url} (forwarded at the frontend's URL; journal "
              f"{journal})")
    _print_members(state["members"])
    print(f"state: {state_dir / 'fleet.json'}  (`rlfleet status`, `rlfleet down`)")
    return 0


def _status(args: argparse.Namespace) -> int:
    import json

    import httpx

    from rlfleet.runtime.launch import read_state, status_local

    state = read_state(Path(args.state))
    if args.rl_url:  # a fleet's status page, wherever it was started
        return _fleet_page(args.rl_url, args.json)
    if state is None:
        print(f"no fleet is up from {args.state}")
        return 1
    if state["mode"] == "ray":
        from rlfleet.runtime.placement import status_ray

        members = status_ray(state, state["address"])
    else:
        members = status_local(state)
    url = (state["members"][0].get("ready") or {}).get("url")
    workers: list[dict] | str = []
    try:
        workers = httpx.get(f"{url}/health", timeout=5).json().get("workers", [])
    except (httpx.HTTPError, ValueError) as e:
        workers = f"frontend at {url} not answering: {e!r}"
    if args.json:
        print(json.dumps({"mode": state["mode"], "members": members, "routed": workers}))
        return 0
    print(f"fleet ({state['mode']}, discovery {state['discovery']}):")
    _print_members(members)
    if isinstance(workers, str):
        print(f"  {workers}")
    else:
        usable = sum(bool(w.get("usable")) for w in workers)
        print(f"frontend routes to {usable} of {len(workers)} registered worker(s)")
        for w in workers:
            print(f"  {w['instance_id']:<20} {w['model']:<24} {w['url']}"
                  f"{'' if w.get('usable') else '  [gated or down]'}")
    rl_url = (state["members"][0].get("ready") or {}).get("rl_url")
    if rl_url:
        print()
        _fleet_page(rl_url, False)
    return 0 if all(m.get("alive") for m in members) else 1


def _fleet_page(rl_url: str, as_json: bool) -> int:
    """Print the RL listener's status page (GET /fleet.json) for a terminal."""
    import json

    import httpx

    from rlfleet.frontend.status import render_text

    try:
        r = httpx.get(f"{rl_url.rstrip('/')}/fleet.json", timeout=10)
        r.raise_for_status()
        snap = r.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"rlfleet status: the RL listener at {rl_url} did not answer: {e!r}",
              file=sys.stderr)
        return 1
    print(json.dumps(snap) if as_json else render_text(snap))
    return 0


def _down(args: argparse.Namespace) -> int:
    from rlfleet.runtime.launch import down_local, read_state

    state_dir = Path(args.state)
    state = read_state(state_dir)
    if state is None:
        print(f"no fleet is up from {state_dir}")
        return 0
    if state["mode"] == "ray":
        from rlfleet.runtime.placement import down_ray

        down_ray(state, state["address"])
    else:
        down_local(state)
    (state_dir / "fleet.json").unlink()
    print(f"rlfleet down: {len(state['members'])} member(s) stopped")
    return 0


def _add_tools(sub: argparse._SubParsersAction) -> None:
    """`make-model`, `digest`, `publish`."""
    mm = sub.add_parser("make-model", help="write a random Qwen3-architecture test checkpoint")
    mm.add_argument("out", help="output directory")
    mm.add_argument("--size", choices=["tiny", "small", "medium"], default="tiny",
                    help="tiny; small: the Qwen3-0.6B geometry; medium: Qwen3-1.7B's")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    mm.add_argument("--arch", choices=["qwen3", "qwen3-moe"], default="qwen3",
                    help="qwen3-moe: a Qwen3-MoE model (8 experts, top-2, every layer)")
    mm.add_argument("--adapter", action="store_true",
                    help="write a random LoRA adapter (peft's format) for a model of --size "
                         "instead of a model")
    mm.add_argument("--rank", type=int, default=8, help="the adapter's rank (with --adapter)")
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
    pb.add_argument("--retain-versions", type=int, default=None, metavar="K",
                    help="after publishing, collect: keep the last K READY versions and every "
                         "version in use, release and evict the rest (needs --catalog; see "
                         "`rlfleet weights gc`)")
    pb.add_argument("--journal", default=os.environ.get("RLFLEET_JOURNAL"),
                    help="with --retain-versions: the refresh journal whose last verified "
                         "policy and workers' holdings are kept too (default: $RLFLEET_JOURNAL)")
    pb.set_defaults(func=_publish)


def _add_weights(sub: argparse._SubParsersAction) -> None:
    """`weights gc`, `weights list`."""
    from rlfleet.weights.retention import DEFAULT_RETAIN, DEFAULT_TOMBSTONES

    wt = sub.add_parser("weights", help="the version catalog: list versions, collect the ones "
                                        "retention does not keep")
    wsub = wt.add_subparsers(dest="weights_command", required=True)
    catalog = Flag("--catalog", os.environ.get("RLFLEET_WEIGHTS_CATALOG"),
                   "version catalog: sqlite:///path or etcd://host:port (default: "
                   "$RLFLEET_WEIGHTS_CATALOG)", required="RLFLEET_WEIGHTS_CATALOG" not in os.environ)
    gc = wsub.add_parser(
        "gc", help="release and evict the versions retention does not keep",
        description="Keep the last K READY versions of each model, every version a live lease "
                    "holds (a worker staging it), every version a worker holds applied, the "
                    "journal's last verified policy and what each worker was last seen holding, "
                    "and the delta chains all of these need; release the rest (leases already "
                    "held stay valid), evict those no lease holds and remove their bytes. "
                    "Prints a JSON report.")
    add_flags(gc, (
        catalog,
        Flag("--retain-versions", DEFAULT_RETAIN,
             "READY versions kept per model besides those in use (default %(default)s)"),
        Flag("--tombstones", DEFAULT_TOMBSTONES,
             "EVICTED records kept per model, so that a request for one is refused by name "
             "(default %(default)s)"),
        Flag("--journal", os.environ.get("RLFLEET_JOURNAL"),
             "the refresh journal whose last verified policy (what a rollback reinstalls) and "
             "workers' holdings are kept (default: $RLFLEET_JOURNAL)"),
        Flag("--s3-endpoint-url", None, "S3 endpoint of the versions' locations"),
        Flag("--dry-run", False, "print the plan, change nothing"),
    ))
    gc.set_defaults(func=_weights_gc)
    ls = wsub.add_parser("list", help="every version in the catalog: state, base, leases, "
                                      "holders, why released")
    add_flags(ls, (catalog, Flag("--model", None, "only this model's versions"),
                   Flag("--json", False, "one JSON object per version")))
    ls.set_defaults(func=_weights_list)


JOURNAL_HELP = ("the refresh journal: a SQLite file, or etcd://host:port[/name] for "
                "coordinators on several hosts; every coordinator of one fleet uses the same "
                "one (it holds the fleet's epochs; a refresh started on it recovers an "
                "unfinished one and knows the last verified policy, what --on-failure "
                "rollback returns to)")


def _coordinator_flags() -> tuple[Flag, ...]:
    """What `rlfleet refresh` and `rlfleet recover` share (RefreshConfig.from_args reads it)."""
    return (
        Flag("--rl-url", os.environ.get("RLFLEET_RL_URL", "http://127.0.0.1:8001"),
             "the frontend's RL listener"),
        Flag("--model", None, "only workers serving this model"),
        Flag("--path", "vllm-disk",
             "how the weights travel: vllm-staged (`rlfleet refresh`'s default: every worker "
             "stages the checkpoint while it serves and the pause holds only the swap; one "
             "that cannot installs it from disk), vllm-disk (`rlfleet recover`'s default: "
             "every worker reloads the checkpoint inside the pause), vllm-distributed, "
             "sglang-disk, vllm-adapter",
             choices=["vllm-staged", "vllm-disk", "vllm-distributed", "sglang-disk",
                      "vllm-adapter"]),
        Flag("--adapter", None,
             "with --path vllm-adapter: the LoRA adapter to refresh (or recover) alone, the "
             "base model and other adapters serving on; --checkpoint is then the adapter's "
             "directory", metavar="NAME"),
        Flag("--sglang-worker", [], metavar="SYSTEM_URL,REQUEST_URL"),
        Flag("--on-failure", "hold", choices=["retry", "rollback", "hold"]),
        Flag("--retries", 1),
        Flag("--pause-mode", "wait", choices=["keep", "wait", "abort"]),
        Flag("--probe-tokens", 8, "tokens each worker generates in the post-update probe"),
        Flag("--probe-tolerance", None,
             "max logprob difference in the probe (default: by the dtype each worker serves "
             "in: float32 1e-3, float16 2e-2, bfloat16 5e-2)", type=float),
        Flag("--probe-from-checkpoint", False,
             "check every worker against a transformers forward pass of the checkpoint (loads "
             "the whole model here); default: the workers must agree with each other on a "
             "prompt their tokenizer makes"),
        Flag("--admin-concurrency", DEFAULT_CONCURRENCY,
             "admin calls (and probes) in flight at once, whatever the fleet's size (default "
             "%(default)s: 1,024 workers take 16 rounds)"),
        Flag("--phase-timeout", None,
             "seconds one phase (gate, pause, apply, verify, ...) may take over the whole "
             "fleet; a worker not done by then is left out as missing and the others go on "
             "(default: 1.25 × the call timeout, 150 s)", type=float),
        Flag("--relay-threshold", RELAY_THRESHOLD,
             "a phase over more workers than this goes through relays: K workers each run "
             "its admin call on their share of the fleet and answer for all of it "
             "(default %(default)s)", type=int),
        Flag("--relay-fanout", None,
             "relays per relayed phase (default: the square root of the phase's workers)",
             type=int),
        Flag("--transfer-backend", "gloo",
             "process-group backend of --path vllm-distributed (nccl needs CUDA here)",
             choices=["gloo", "nccl"]),
        Flag("--master-address", None,
             "address the workers reach this host at for --path vllm-distributed (default: "
             "this host's address on the route to the workers)"),
        Flag("--master-port", None,
             "rendezvous port for --path vllm-distributed (default: a free port)", type=int),
        Flag("--admin-token", os.environ.get("RLFLEET_ADMIN_TOKEN")),
        Flag("--journal", str(default_journal()), JOURNAL_HELP),
        Flag("--discovery", None,
             "the discovery store where the committed policy is published for the frontends "
             "(default: the one the RL listener names)"),
    )


#: `rlfleet refresh`'s own flags, beside the coordinator's
REFRESH_FLAGS = (
    Flag("--checkpoint", None,
         "checkpoint directory the workers can read (required unless --source)"),
    Flag("--version", None, "the version to declare", required=True),
    Flag("--digest", None, "target digest (default: the one every worker computes as it "
         "stages the checkpoint; on the other paths, computed here from the checkpoint)"),
    Flag("--staged", False,
         "--path vllm-staged (the default): workers pull the version while they serve "
         "(stage_weights); the fleet is gated only to install it"),
    Flag("--source", None,
         "where workers stage the version from (the staged and adapter paths): "
         "s3://bucket/prefix/VERSION, a version directory, or a trainer publisher's "
         "http://host:port"),
    Flag("--s3-endpoint-url", None, "S3 endpoint of --source (default: boto3's own)"),
    Flag("--probe-before-reopen", False,
         "probe every worker before the fleet reopens (default: the verified workers reopen, "
         "then the probe runs; a worker that fails it is closed again: docs/refresh.md)"),
    Flag("--stage-fanout", 0,
         "with --staged and an S3, directory or trainer --source: 0 (default), every worker "
         "pulls from the source; 1, a pipelined chain over the workers in discovery (only the "
         "first pulls from the source, each one serves the next while it still receives); K, "
         "a K-ary tree", metavar="K"),
    Flag("--step", None,
         "the policy's fleet step (workers stamp it on every token; steps only increase; "
         "default: one above the step the fleet serves)", type=int),
    Flag("--mode", "sync",
         "sync: the whole fleet gated while it changes; rolling: workers updated in waves "
         "while the rest serve", choices=["sync", "rolling"]),
    Flag("--max-lag", 1,
         "rolling: refuse a target more than this many steps ahead of a serving worker"),
    Flag("--min-serving", 1, "rolling: never fewer workers serving than this"),
    Flag("--wave-size", None,
         "rolling: workers updated at once (default: all but --min-serving)", type=int),
)


def _add_refresh(sub: argparse._SubParsersAction) -> None:
    """`refresh` and `recover`."""
    rf = sub.add_parser("refresh", help="move a fleet to a checkpoint (policy refresh)")
    add_flags(rf, REFRESH_FLAGS + _coordinator_flags())
    rf.set_defaults(func=run_refresh, path="vllm-staged")  # stage first, pause for the swap

    rc = sub.add_parser("recover", help="recover a fleet whose refresh never finished (its "
                                        "coordinator crashed or was stopped)",
                        description="Fence and pause every worker, then roll forward when "
                                    "every worker holds the interrupted target, else back to "
                                    "the last verified policy; the fleet reopens only on one "
                                    "verified policy. `rlfleet refresh` does this first too.")
    add_flags(rc, _coordinator_flags())
    rc.set_defaults(func=_recover)


def _control(args: argparse.Namespace) -> int:
    """`rlfleet control`: the fleet control service (rlfleet.refresh.fleet_control)."""
    import asyncio

    from rlfleet.refresh.config import RefreshConfig
    from rlfleet.refresh.fleet_control.app import serve

    asyncio.run(serve(RefreshConfig.from_args(args), args.host, args.port, args.log_format))
    return 0


def _add_control(sub: argparse._SubParsersAction) -> None:
    """`control`: one URL for single-server clients, every call a fleet operation."""
    ct = sub.add_parser(
        "control", help="serve vLLM's and SGLang's control routes for the whole fleet at one "
                        "URL (each call a fleet transaction; see docs/one-url.md)",
        description="A long-lived coordinator: pause, resume, weight updates (from disk or "
                    "vLLM's four-phase transfer), cache resets and LoRA adapters, as a single "
                    "vLLM or SGLang server takes them, each mapped onto the fleet lifecycle "
                    "and recorded in one journal; unfinished transactions are recovered at "
                    "start. Frontends forward these routes to it with --fleet-control URL.")
    add_flags(ct, (Flag("--host", "127.0.0.1",
                        "bind address (default loopback: several clients cannot send the "
                        "admin token; bind wider only on a trusted network)"),
                   Flag("--port", 8002, "port (0: a free one; the ready line names it)"))
              + _coordinator_flags())
    ct.set_defaults(func=_control, on_failure="rollback", path="vllm-disk")


def _add_journal(sub: argparse._SubParsersAction) -> None:
    """`journal`."""
    jn = sub.add_parser("journal", help="show past policy refreshes")
    jn.add_argument("--journal", default=str(default_journal()),
                    help="a SQLite file or etcd://host:port[/name]")
    jn.add_argument("--limit", type=int, default=20)
    jn.add_argument("--json", action="store_true")
    jn.set_defaults(func=_journal)


def _add_fleet(sub: argparse._SubParsersAction) -> None:
    """`up`, `status`, `down`."""
    from rlfleet.runtime.launch import default_state_dir

    state_help = "where the running fleet is recorded (default: $RLFLEET_STATE or ~/.local/state)"
    up = sub.add_parser("up", help="start a frontend and workers: local processes, or Ray "
                                   "actors with --ray",
                        description="Start a fleet and return once every member is ready. "
                                    "Worker flags after `--` go to every worker.")
    up.add_argument("--config", default=None, help="fleet.yaml (discovery, namespace, "
                                                   "frontend, workers: see the README)")
    up.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                    help="run every member as a Ray actor on this cluster (GPUs per worker = "
                         "tensor x pipeline parallel size); restarted by Ray when it dies")
    up.add_argument("--ray-namespace", default="rlfleet", help="Ray namespace of the actors")
    up.add_argument("--kind", choices=["vllm", "mocker"], default=None,
                    help="worker kind (default vllm)")
    up.add_argument("--workers", type=int, default=None, help="number of workers (default 1)")
    up.add_argument("--discovery", default=None,
                    help="etcd://host:port for a fleet across hosts (default: $RLFLEET_DISCOVERY, "
                         "$ETCD_ENDPOINTS, else a directory under --state)")
    up.add_argument("--admin-token-file", default=os.environ.get("RLFLEET_ADMIN_TOKEN_FILE"),
                    help="the fleet's admin token, read from this file by the frontend and "
                         "every worker (with Ray: a path every node can read; default "
                         "$RLFLEET_ADMIN_TOKEN_FILE)")
    up.add_argument("--processes", type=int, default=None, metavar="K",
                    help="the frontend serves its port from K processes (its --processes: "
                         "SO_REUSEPORT, /metrics summed over them; default: the config's, "
                         "else 1)")
    up.add_argument("--state", default=str(default_state_dir()), help=state_help)
    up.add_argument("--timeout", type=float, default=600, help="seconds to wait for readiness")
    up.add_argument("worker_args", nargs=argparse.REMAINDER,
                    help="-- then flags for every worker (e.g. -- --model DIR --enable-rl)")
    up.set_defaults(func=_up)

    st = sub.add_parser("status", help="the fleet started by `rlfleet up`: members and routing")
    st.add_argument("--state", default=str(default_state_dir()), help=state_help)
    st.add_argument("--json", action="store_true")
    st.add_argument("--rl-url", default=None,
                    help="print the status page of the fleet behind this RL listener (GET "
                         "/fleet.json): workers, policies, gate, last refreshes")
    st.set_defaults(func=_status)

    dn = sub.add_parser("down", help="stop everything `rlfleet up` started (processes, actors)")
    dn.add_argument("--state", default=str(default_state_dir()), help=state_help)
    dn.set_defaults(func=_down)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """`demo`."""
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
    de.add_argument("--async", dest="asynchronous", action="store_true",
                    help="the asynchronous loop: rollouts go on while the trainer trains, "
                         "rolling refreshes, a staleness bound per token")
    de.add_argument("--max-staleness", type=int, default=1,
                    help="with --async: steps a trained token's policy may lag the trainer's")
    # the demo's own lines are its progress: the library's are for --log-level info / debug
    de.set_defaults(func=_demo, default_log_level="warning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet", description=__doc__)
    add_log_args(p)  # before the command: `rlfleet --log-format json publish ...`
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_tools, _add_weights, _add_refresh, _add_journal, _add_fleet, _add_demo,
                _add_control):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # progress of long work (digest, publish, stage) and refresh phases are log lines
    setup_logging(args.log_level, args.log_format,
                  default_level=getattr(args, "default_log_level", "info"))
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError, TimeoutError) as e:
        print(f"rlfleet {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
