"""Where the XOR-delta codec's time goes, each stage beside a plain copy of the same bytes.

    python bench/codec.py [--tensors 40] [--mib 8] [--changed 0.015]

Synthetic bf16 tensors, a fraction of their elements nudged by a few units in the last
place (what an AdamW step at a small learning rate does to bf16 weights), encoded as the
artifact format does it (rlfleet.weights.artifacts.encode_delta: XOR against the base,
a zstd level-1 frame per tensor, Adler-32 of the target), and each stage timed alone:
the XOR, the Adler-32, zstd at level 1 and at a fast negative level, zstd with its own
threads; and decoding (decompress, XOR onto the base, Adler-32 of the target), with the
codec's threads and with one. Prints GB/s of each (best of 3) and its ratio to the copy; the
delta's size ÷ full. It answers one question: which stage bounds the codec's speed
(bench/weights.py measures the whole refresh)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import zstandard

from rlfleet.weights import artifacts as art


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--mib", type=int, default=8, help="size of each tensor")
    p.add_argument("--changed", type=float, default=0.015, help="fraction of elements changed")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    elements = (a.mib << 20) // 2
    names = [f"t{i}" for i in range(a.tensors)]
    base_t = {n: torch.randn(elements, dtype=torch.bfloat16) for n in names}
    cur_t = {}
    for n, b in base_t.items():
        c = b.clone().view(torch.int16)
        idx = torch.from_numpy(rng.choice(elements, int(elements * a.changed), replace=False))
        c[idx] += torch.from_numpy(rng.integers(-2, 3, len(idx)).astype(np.int16))
        cur_t[n] = c.view(torch.bfloat16)
    base = {n: art.tensor_bytes(t) for n, t in base_t.items()}
    cur = {n: art.tensor_bytes(t) for n, t in cur_t.items()}
    total = sum(x.nbytes for x in cur.values())
    out = {n: np.zeros_like(x) for n, x in cur.items()}
    xors = [np.bitwise_xor(cur[n], base[n]) for n in names]

    def gbps(f) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e9

    def zstd(level: int, threads: int = 0) -> None:
        c = zstandard.ZstdCompressor(level=level, threads=threads)
        for x in xors:
            c.compress(x)

    frames = {n: art.encode_tensor(cur[n], base[n]) for n in names}
    copy = gbps(lambda: [np.copyto(out[n], cur[n]) for n in names])
    rows = [
        ("plain copy (baseline)", copy),
        ("encode_delta (the codec)", gbps(lambda: art.encode_delta("v1", "v0", cur_t, base, "-"))),
        ("encode_delta, 1 thread", gbps(lambda: art.encode_delta("v1", "v0", cur_t, base, "-",
                                                                  threads=1))),
        ("decode_deltas (the codec)", gbps(lambda: art.decode_deltas(
            (n, f, base[n], out[n], c) for n, (f, c) in frames.items()))),
        ("decode_deltas, 1 thread", gbps(lambda: art.decode_deltas(
            ((n, f, base[n], out[n], c) for n, (f, c) in frames.items()), threads=1))),
        ("XOR only", gbps(lambda: [np.bitwise_xor(cur[n], base[n], out=out[n]) for n in names])),
        ("Adler-32 only", gbps(lambda: [art.adler32_hex(cur[n]) for n in names])),
        ("zstd level 1 only", gbps(lambda: zstd(1))),
        ("zstd level -5 only", gbps(lambda: zstd(-5))),
        ("zstd level 1, 2 threads", gbps(lambda: zstd(1, 2))),
    ]
    delta = art.encode_delta("v1", "v0", cur_t, base, "-")
    print(f"{a.tensors} bf16 tensors x {a.mib} MiB, {a.changed:.1%} of elements changed; "
          f"delta ÷ full {sum(len(d) for _, d in delta.files) / total:.4f}")
    for name, v in rows:
        print(f"  {name:28s} {v:6.2f} GB/s   copy ÷ this {copy / v:5.2f}")


if __name__ == "__main__":
    main()
