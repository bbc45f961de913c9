"""The `rlfleet` command: one subcommand per user task."""

from __future__ import annotations

import argparse
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
    from rlfleet.demo import run_demo

    run_demo(Path(args.out))
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

    de = sub.add_parser("demo", help="run the demo on a local fleet")
    de.add_argument("--out", default="rlfleet-demo", help="output directory")
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
