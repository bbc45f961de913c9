"""python -m rlfleet.mocker [--model-name NAME] [--token-delay S] [--max-batch N]
                           [--admin-schema vllm|sglang] [worker flags]

A simulated worker for load and fault tests: it registers and serves like a vLLM worker
(or, with --admin-schema sglang, offers the SGLang-flavoured /engine routes) but generates
pseudo-random tokens. Never use it as a stand-in for the real engine."""

from __future__ import annotations

import argparse
import logging
import os

from rlfleet.mocker.admin import SCHEMAS, MockAdmin
from rlfleet.mocker.engine import MockEngine, add_mock_args
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.serve import add_worker_args, run_worker, settle_worker_args, staging_area

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
    args = p.parse_args(argv)
    try:
        settle_worker_args(args)
        engine = MockEngine(args)
        staging = staging_area(args, engine) if args.admin_schema == "vllm" else None
        admin = MockAdmin(engine, args.allowed_weights_root, schema=args.admin_schema,
                          engine_routes=os.environ.get("DYN_SGLANG_ENGINE_ROUTES"),
                          staging=staging)
    except ValueError as e:
        p.error(str(e))
    if args.admin_schema == "sglang" and args.enable_rl:
        # SGLang workers do not register with GET /v1/rl/workers (CONTRACT.md)
        log.warning("--enable-rl ignored: SGLang-schema workers do not register the rl endpoint")
        args.enable_rl = False
    run_worker(engine, args, admin.routes, staging=staging, admission=admin.vllm.admission,
               fence=admin.fence, mounted=NativeRL(admin.vllm))


if __name__ == "__main__":
    main()
