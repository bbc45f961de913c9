"""What the KV router learns of its workers' speed from the requests it routes (no probe, no
flag): seconds per prompt token prefilled, the decode step time as a function of the
requests a worker runs (a straight line: step = base + per_seq x running), and how many
tokens a request generates. Each is a decaying average over recent requests, fleet-wide (the
workers of one fleet run one engine on one kind of machine).

- prefill: a request's time to first token, over the prompt tokens its worker had to compute
  before it could answer (the uncached tokens of the requests routed there and not yet
  answered when it was routed, its own included);
- decode: each gap between two of a request's token events, per token, against the requests
  its worker had in flight;
- output: the tokens each request generated.

Until it has seen enough, `known` is False and the router weighs tokens by fixed weights."""

from __future__ import annotations

DECAY = 0.97  # per sample: about the last 30 samples count
MIN_PREFILL_TOKENS = 32  # a first token after fewer says nothing about the prefill rate
MIN_SAMPLES = 4


class Rates:
    def __init__(self) -> None:
        self._pf = [0.0, 0.0, 0]  # decayed seconds, tokens; samples
        self._dc = [0.0] * 5 + [0]  # decayed n, sum b, sum t, sum b*b, sum b*t; samples
        self._out = [0.0, 0.0]  # decayed tokens, requests

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            pf = self._pf
            pf[0] = pf[0] * DECAY + seconds
            pf[1] = pf[1] * DECAY + tokens
            pf[2] += 1

    def decoded(self, running: int, seconds_per_token: float) -> None:
        if seconds_per_token <= 0:
            return
        d, b, t = self._dc, float(running), seconds_per_token
        for i, x in enumerate((1.0, b, t, b * b, b * t)):
            d[i] = d[i] * DECAY + x
        d[5] += 1

    def generated(self, tokens: int) -> None:
        self._out[0] = self._out[0] * DECAY + tokens
        self._out[1] = self._out[1] * DECAY + 1

    @property
    def known(self) -> bool:
        return self._pf[2] >= MIN_SAMPLES

    @property
    def prefill(self) -> float:
        """Seconds per prompt token computed (0 while unknown)."""
        return self._pf[0] / self._pf[1] if self.known else 0.0

    def step(self) -> tuple[float, float]:
        """(base, per running request): seconds of one decode step (0s while unknown)."""
        n, sb, st, sbb, sbt, samples = self._dc
        if samples < MIN_SAMPLES or n <= 0:
            return 0.0, 0.0
        mb, mt = sb / n, st / n
        var = sbb / n - mb * mb
        per = max(0.0, (sbt / n - mb * mt) / var) if var > 1e-9 else 0.0
        return max(0.0, mt - per * mb), per

    @property
    def output(self) -> float:
        """Tokens a request generates, on average (0 while unknown)."""
        return self._out[0] / self._out[1] if self._out[1] else 0.0

    def describe(self) -> dict:
        base, per = self.step()
        return {"prefill_s_per_token": round(self.prefill, 6),
                "decode_step_s": round(base, 5), "decode_s_per_running": round(per, 6),
                "output_tokens": round(self.output, 1)}
