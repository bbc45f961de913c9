"""python -m rlfleet.mocker [--model-name NAME] [--token-delay S] [--max-batch N] [worker flags]

A simulated worker for load and fault tests: it registers and serves like a vLLM worker
but generates pseudo-random tokens. Never use it as a stand-in for the real engine."""

from __future__ import annotations

import argparse
import asyncio

from rlfleet.mocker.engine import MockEngine, add_mock_args
from rlfleet.runtime.worker import add_worker_args, serve_worker


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlfleet.mocker",
                                description="A simulated rlfleet worker for load and fault tests "
                                            "(pseudo-random tokens, no model)")
    add_mock_args(p)
    add_worker_args(p)
    args = p.parse_args(argv)
    try:
        engine = MockEngine(args)
    except ValueError as e:
        p.error(str(e))
    asyncio.run(serve_worker(engine, args))


if __name__ == "__main__":
    main()
