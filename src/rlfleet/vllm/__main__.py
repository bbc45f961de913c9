"""python -m rlfleet.vllm --model DIR [--served-model-name NAME] [--enable-rl] [--discovery URL]"""

from __future__ import annotations

import argparse
import asyncio

from rlfleet.runtime.admin import EngineAdmin
from rlfleet.runtime.worker import add_worker_args, serve_worker
from rlfleet.vllm.engine import VllmEngine, add_engine_args


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlfleet.vllm",
                                description="An rlfleet worker around the vLLM engine")
    add_engine_args(p)
    add_worker_args(p)
    args = p.parse_args(argv)
    engine = VllmEngine(args)
    admin = EngineAdmin(engine, args.allowed_weights_root)
    asyncio.run(serve_worker(engine, args, admin.routes))


if __name__ == "__main__":
    main()
