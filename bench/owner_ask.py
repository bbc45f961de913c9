"""What a request with an X-Request-Id pays when a frontend places it elsewhere than on its
ID's top-ranked worker: one attach-only request to each worker ranked above
(rlfleet.frontend.router.ask_owners), side by side with the request it precedes (a kept
generation of one token), on one stream-plane link to an in-process worker over the
mocker with no token delay (the declared simulator: this measures the request plane, not
an engine; both ends share this process's one core, so each figure is both sides' CPU).

    python bench/owner_ask.py [--requests 2000] [--rounds 3]

Per round, alternated: the mean time of an ask that finds no run (the usual answer: the
worker then remembers where the request went), of an ask that finds one (following a
finished one-token run from its start), and of a one-token kept generation. Requests
without an ID, and those placed on their ID's first worker, ask nothing. The last line is
one JSON object: {"ask_us": us, "attach_us": us, "generate_us": us,
"ratio_ask_over_generate": r}."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import msgspec

from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol.engine import GenerateRequest
from rlfleet.runtime.request_plane import StreamClient
from rlfleet.runtime.server import bind_socket
from rlfleet.worker.stream_server import WorkerPlane


def kept(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[11, 12, 13], retain="body",
                           sampling={"max_tokens": 1, "ignore_eos": True})


async def timed(n: int, one) -> float:
    """Mean microseconds of `one(i)` over `n` calls, one after the other."""
    start = time.perf_counter()
    for i in range(n):
        await one(i)
    return (time.perf_counter() - start) / n * 1e6


async def run(requests: int, rounds: int) -> dict:
    server = await WorkerPlane(MockEngine(token_delay=0.0)).serve(bind_socket("127.0.0.1", 0))
    addr = f"127.0.0.1:{server.port}"
    client = StreamClient()
    figures: dict[str, list[float]] = {"ask": [], "attach": [], "generate": []}
    try:
        async def generate(tag: str, i: int) -> None:
            async for _ in await client.generate(addr, kept(f"{tag}-{i}")):
                pass

        async def ask(tag: str, i: int) -> None:
            probe = msgspec.structs.replace(kept(f"{tag}-{i}"), attach_only=True,
                                            placed_at="127.0.0.1:1")
            stream = await client.attach(addr, probe, 5.0)
            if stream is not None:
                async for _ in stream:
                    pass
            elif tag.startswith("g"):
                raise AssertionError(f"the run {tag}-{i} was not found")

        await generate("warm", 0)
        for r in range(rounds):
            kept_tag, none_tag = f"g{r}", f"n{r}"
            figures["generate"].append(
                await timed(requests, lambda i, t=kept_tag: generate(t, i)))
            figures["attach"].append(await timed(requests, lambda i, t=kept_tag: ask(t, i)))
            figures["ask"].append(await timed(requests, lambda i, t=none_tag: ask(t, i)))
            print(f"round {r + 1}: ask (none kept) {figures['ask'][-1]:.0f} us, ask (kept, "
                  f"followed) {figures['attach'][-1]:.0f} us, one-token kept generation "
                  f"{figures['generate'][-1]:.0f} us", flush=True)
    finally:
        await client.close()
        await server.stop(grace=0)
    best = {k: min(v) for k, v in figures.items()}
    return {"ask_us": round(best["ask"], 1), "attach_us": round(best["attach"], 1),
            "generate_us": round(best["generate"], 1),
            "ratio_ask_over_generate": round(best["ask"] / best["generate"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    out = asyncio.run(run(a.requests, a.rounds))
    print(f"best of {a.rounds}: ask {out['ask_us']} us vs generation {out['generate_us']} us "
          f"(ratio {out['ratio_ask_over_generate']}); attach {out['attach_us']} us")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
