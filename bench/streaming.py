"""Frontend CPU per generated token for long streams, against a bare relay of the same bytes.

rlfleet: the frontend in front of one mocker worker (the declared simulator; engine cost
is not what is measured), STREAMS concurrent streamed completions of TOKENS tokens each,
with sampled-token logprobs and nvext.completion_token_ids (what an RL rollout asks for),
the mocker pacing each stream at one token per TOKEN_DELAY seconds.

Baseline: a bare aiohttp server that relays the same SSE bytes from an upstream: the
stream is first captured from the rlfleet frontend, then a source process serves exactly
those events at the same pace, and the relay forwards them chunk by chunk to the same
clients. The relay does the least a Python HTTP hop can do (read a chunk, write it).

    python bench/streaming.py [--streams 64] [--tokens 1024] [--token-delay 0.004] [--rounds 2]

Prints CPU seconds per 1,000 generated tokens of the frontend process and of the relay
process, and their ratio (rlfleet / relay), per round and the median."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "bench-stream"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(args: argparse.Namespace, seed: int) -> dict:
    return {"model": MODEL, "prompt": [1101, 1102, 1103, 1104], "max_tokens": args.tokens,
            "ignore_eos": True, "stream": True, "logprobs": 0, "seed": seed,
            "nvext": {"extra_fields": ["completion_token_ids"]}}


async def run_clients(url: str, args: argparse.Namespace, body_of) -> tuple[int, float]:
    """STREAMS concurrent streams read to the end; (bytes received, seconds)."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    total = 0
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(i: int) -> int:
            async with http.post(url, json=body_of(i)) as r:
                assert r.status == 200, await r.text()
                data = await r.read()
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            return len(data)

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(one(i) for i in range(args.streams))))
        return total, time.perf_counter() - t0


# ------------------------------------------------------------------ baseline processes


def serve_source(port: int, events_file: str, delay: float) -> None:
    """Serves the captured SSE events of one stream, one every `delay` seconds."""
    from aiohttp import web

    events = json.loads(Path(events_file).read_text())
    chunks = [e.encode("latin-1") for e in events]

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await asyncio.sleep(delay)
            await resp.write(c)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_relay(port: int, upstream: str) -> None:
    """A bare relay: each request is forwarded upstream and the response streamed back."""
    import aiohttp
    from aiohttp import web

    async def start(app: web.Application) -> None:
        app["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["http"].close()

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["http"].post(upstream, data=body,
                                            headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_listening(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


# ------------------------------------------------------------------ phases


def measure_rlfleet(fleet, args: argparse.Namespace) -> dict:
    pid = fleet.frontend.pid
    c0 = cpu_seconds(pid)
    nbytes, secs = asyncio.run(run_clients(f"{fleet.url}/v1/completions", args,
                                           lambda i: request_body(args, i)))
    cpu = cpu_seconds(pid) - c0
    tokens = args.streams * args.tokens
    return {"tokens": tokens, "seconds": secs, "cpu_s": cpu, "bytes": nbytes}


def capture(fleet, args: argparse.Namespace, path: Path) -> int:
    """One stream from the frontend, split into its SSE events, written to `path`."""
    import httpx

    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=request_body(args, 0),
                      timeout=120) as r:
        raw = b"".join(r.iter_raw())
    events = [e + "\n\n" for e in raw.decode("latin-1").split("\n\n") if e]
    ids = [t for e in events if e.startswith("data: {")
           for t in json.loads(e[6:]).get("nvext", {}).get("completion_token_ids", [])]
    assert len(ids) == args.tokens, len(ids)
    path.write_text(json.dumps(events))
    return len(events)


def measure_relay(relay_pid: int, relay_port: int, args: argparse.Namespace) -> dict:
    c0 = cpu_seconds(relay_pid)
    nbytes, secs = asyncio.run(run_clients(f"http://127.0.0.1:{relay_port}/v1/completions",
                                           args, lambda i: request_body(args, i)))
    cpu = cpu_seconds(relay_pid) - c0
    return {"tokens": args.streams * args.tokens, "seconds": secs, "cpu_s": cpu, "bytes": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--token-delay", type=float, default=0.004)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--role", choices=["source", "relay"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--arg", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "source":
        serve_source(args.port, args.arg, args.token_delay)
        return
    if args.role == "relay":
        serve_relay(args.port, args.arg)
        return

    from rlfleet.testing.fleet import LocalFleet

    rows = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-stream-") as tmp, \
            LocalFleet(Path(tmp) / "fleet") as fleet:
        fleet.start_frontend("--log-level", "warning")
        fleet.start_worker("--served-model-name", MODEL, "--token-delay", str(args.token_delay),
                           "--max-model-len", str(args.tokens + 64), "--log-level", "warning",
                           kind="mocker")
        import httpx

        while not httpx.get(f"{fleet.url}/v1/models", timeout=5).json()["data"]:
            time.sleep(0.2)
        events_file = Path(tmp) / "events.json"
        n_events = capture(fleet, args, events_file)
        src_port, relay_port = free_port(), free_port()
        me = [sys.executable, __file__, "--token-delay", str(args.token_delay)]
        source = subprocess.Popen([*me, "--role", "source", "--port", str(src_port),
                                   "--arg", str(events_file)])
        relay = subprocess.Popen([*me, "--role", "relay", "--port", str(relay_port),
                                  "--arg", f"http://127.0.0.1:{src_port}/v1/completions"])
        try:
            wait_listening(src_port)
            wait_listening(relay_port)
            for r in range(args.rounds):
                fe = measure_rlfleet(fleet, args)
                rl = measure_relay(relay.pid, relay_port, args)
                row = {"round": r + 1,
                       "frontend_cpu_ms_per_1k_tokens": 1e6 * fe["cpu_s"] / fe["tokens"],
                       "relay_cpu_ms_per_1k_tokens": 1e6 * rl["cpu_s"] / rl["tokens"],
                       "frontend_tokens_per_s": fe["tokens"] / fe["seconds"],
                       "relay_tokens_per_s": rl["tokens"] / rl["seconds"],
                       "bytes_per_stream": fe["bytes"] // args.streams}
                row["ratio"] = row["frontend_cpu_ms_per_1k_tokens"] / row["relay_cpu_ms_per_1k_tokens"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
        finally:
            for proc in (relay, source):
                proc.terminate()
                proc.wait(10)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    print(f"streams={args.streams} tokens={args.tokens} token_delay={args.token_delay} "
          f"sse_events_per_stream={n_events}")
    print(f"frontend: {med['frontend_cpu_ms_per_1k_tokens']:.1f} ms CPU per 1k tokens "
          f"({med['frontend_tokens_per_s']:.0f} tok/s)")
    print(f"relay   : {med['relay_cpu_ms_per_1k_tokens']:.1f} ms CPU per 1k tokens "
          f"({med['relay_tokens_per_s']:.0f} tok/s)")
    print(f"ratio frontend/relay = {med['ratio']:.3f} (median of {len(rows)} rounds)")


if __name__ == "__main__":
    main()
