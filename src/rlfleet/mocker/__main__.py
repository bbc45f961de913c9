"""python -m rlfleet.mocker [--model-name NAME] [--token-delay S] [--max-batch N]
                           [--admin-schema vllm|sglang] [--replicas N]
                           [--enable-lora --max-loras N --max-lora-rank R
                            --lora-modules NAME=PATH ...] [worker flags]

A simulated worker for load and fault tests: it registers and serves like a vLLM worker
(or, with --admin-schema sglang, offers the SGLang-flavoured /engine routes) but generates
pseudo-random tokens (a request naming a LoRA adapter gets tokens seeded by the adapter's
content digest, rlfleet.mocker.adapters). Never use it as a stand-in for the real engine. `--replicas N`: N
independent simulated workers in this one process (a fleet for scale tests)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from rlfleet.mocker.admin import SCHEMAS, MockAdmin
from rlfleet.mocker.engine import MockEngine, add_mock_args
from rlfleet.weights.staging import default_staging_root
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.serve import (
    WorkerParts,
    add_worker_args,
    run_workers,
    settle_worker_args,
    staging_area,
)

log = logging.getLogger("rlfleet.mocker")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlfleet.mocker",
                                description="A simulated rlfleet worker for load and fault tests "
                                            "(pseudo-random tokens, no model)")
    add_mock_args(p)
    p.add_argument("--admin-schema", choices=SCHEMAS, default="vllm",
                   help="the /engine route table: vllm (default) or sglang (fixed control/* "
                        "routes plus the methods allow-listed in $DYN_SGLANG_ENGINE_ROUTES)")
    add_worker_args(p)
    p.add_argument("--replicas", type=int, default=1,
                   help="simulate this many independent workers in this process, each with "
                        "its own request plane, system server, admin state and discovery "
                        "entries (on etcd all share the process's one lease), on free ports "
                        "(--port and --system-port must be 0 or unset); one ready line once "
                        "all are registered")
    args = p.parse_args(argv)
    try:
        settle_worker_args(args)
        parts = [_replica(args, i) for i in range(args.replicas)] if _check_replicas(args) \
            else []
    except ValueError as e:
        p.error(str(e))
    run_workers(parts)


def _check_replicas(args: argparse.Namespace) -> bool:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, not {args.replicas}")
    if args.replicas > 1 and (args.port or args.system_port):
        raise ValueError("with --replicas, --port and --system-port must be 0 or unset: each "
                         "replica listens on free ports of its own")
    if args.replicas > 1 and not args.weights_staging_dir:
        args.weights_staging_dir = str(default_staging_root())
    if args.admin_schema == "sglang" and args.enable_rl:
        # SGLang workers do not register with GET /v1/rl/workers (docs/contract.md)
        log.warning("--enable-rl ignored: SGLang-schema workers do not register the rl endpoint")
        args.enable_rl = False
    return True


def _replica(args: argparse.Namespace, i: int) -> WorkerParts:
    """Simulated worker `i` of `args.replicas`: its own engine, admin state and staging
    area (replicas after the first stage under a directory of their own)."""
    if args.replicas > 1:
        args = argparse.Namespace(**vars(args))
        args.weights_staging_dir = str(Path(args.weights_staging_dir) / f"replica-{i}")
    engine = MockEngine(args)
    staging = staging_area(args, engine) if args.admin_schema == "vllm" else None
    admin = MockAdmin(engine, args.allowed_weights_root, schema=args.admin_schema,
                      engine_routes=os.environ.get("DYN_SGLANG_ENGINE_ROUTES"),
                      staging=staging)
    return WorkerParts(engine, args, admin.routes, staging=staging,
                       admission=admin.vllm.admission, fence=admin.fence,
                       mounted=NativeRL(admin.vllm))

if __name__ == "__main__":
    main()
