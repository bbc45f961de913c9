"""Generated tokens/s through the frontend (frontend + 1 vLLM worker) against vLLM's
AsyncLLM driven directly in one process, same model and engine settings, same load:
CONCURRENCY requests in flight, each MAX_TOKENS tokens with sampled-token logprobs.

    python bench/throughput.py [--size tiny|small] [--requests 256] [--concurrency 64]

Prints both rates and the ratio (frontend / direct)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT = [151644, 8948, 198, 40, 1079, 264, 1273, 13]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-model-len", "2048"]
    return flags + (["--enforce-eager"] if args.eager else [])


async def load(send, requests: int, concurrency: int) -> tuple[int, float]:
    """Run `requests` calls of `send()` with `concurrency` in flight; (tokens, seconds)."""
    sem = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with sem:
            return await send()

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(requests))))
    return tokens, time.perf_counter() - t0


def direct(args: argparse.Namespace) -> None:
    """Child process: AsyncLLM in this process, no HTTP."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rlfleet.vllm.args import parse_args
    from rlfleet.vllm.engine import VllmEngine

    eargs = parse_args(["--model", args.model, "--served-model-name", "bench",
                        *engine_flags(args)])
    engine = VllmEngine(eargs)

    async def main() -> None:
        await engine.start()
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=0,
                            temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY)
        n = 0

        async def send() -> int:
            nonlocal n
            n += 1
            outs = [o async for o in engine.llm.generate(TokensPrompt(prompt_token_ids=PROMPT),
                                                         sp, f"bench-{n}")]
            return len(outs[-1].outputs[0].token_ids)

        await load(send, args.concurrency, args.concurrency)  # warm-up
        tokens, secs = await load(send, args.requests, args.concurrency)
        print(json.dumps({"tokens": tokens, "seconds": secs}), flush=True)
        await engine.shutdown()

    asyncio.run(main())


def through_frontend(args: argparse.Namespace, workdir: Path) -> tuple[int, float]:
    from rlfleet.testing.fleet import LocalFleet

    with LocalFleet(workdir / "fleet") as fleet:
        fleet.start_frontend()
        fleet.start_worker("--model", args.model, "--served-model-name", "bench",
                           *engine_flags(args), timeout=900)
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.max_tokens,
                "ignore_eos": True, "logprobs": 0, "temperature": 1.0,
                "nvext": {"extra_fields": ["completion_token_ids"]}}

        async def main() -> tuple[int, float]:
            limits = httpx.Limits(max_connections=args.concurrency * 2)
            async with httpx.AsyncClient(timeout=600, limits=limits) as http:
                while not (await http.get(f"{fleet.url}/v1/models")).json()["data"]:
                    await asyncio.sleep(0.2)

                async def send() -> int:
                    r = await http.post(f"{fleet.url}/v1/completions", json=body)
                    r.raise_for_status()
                    return len(r.json()["nvext"]["completion_token_ids"])

                await load(send, args.concurrency, args.concurrency)  # warm-up
                return await load(send, args.requests, args.concurrency)

        return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="--enforce-eager on both sides")
    p.add_argument("--model", default=None, help="checkpoint dir (default: make one)")
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.direct:
        direct(args)
        return
    from rlfleet.models import make_model
    from rlfleet.runtime.launch import engine_env

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        work = Path(tmp)
        if args.model is None:
            args.model = str(make_model(work / "model", size=args.size, seed=0, dtype=args.dtype))
        child = [sys.executable, __file__, "--direct", "--model", args.model,
                 "--dtype", args.dtype, "--requests", str(args.requests),
                 "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
        if args.eager:
            child.append("--eager")
        out = subprocess.run(child, capture_output=True, text=True, env=engine_env(), check=True)
        base = json.loads(next(line for line in out.stdout.splitlines()
                               if line.startswith('{"tokens"')))
        tokens, secs = through_frontend(args, work)
    d_rate = base["tokens"] / base["seconds"]
    f_rate = tokens / secs
    print(f"model={args.size} dtype={args.dtype} requests={args.requests} "
          f"concurrency={args.concurrency} max_tokens={args.max_tokens} eager={args.eager}")
    print(f"direct AsyncLLM : {d_rate:9.1f} tok/s ({base['tokens']} tokens in {base['seconds']:.2f} s)")
    print(f"through frontend: {f_rate:9.1f} tok/s ({tokens} tokens in {secs:.2f} s)")
    print(f"ratio frontend/direct = {f_rate / d_rate:.3f}")


if __name__ == "__main__":
    main()
