"""An engine behind the engine-control interface, driven in process (no HTTP): greedy
generation of a fixed prompt, for comparing what an engine serves with a reference."""

from __future__ import annotations

import torch

from rlfleet.protocol.engine import GenerateRequest, SamplingOptions, Step

PROMPT = [151644, 8948, 198, 40, 1079]


async def greedy(engine, n: int = 8) -> tuple[list[int], list[float]]:
    """The engine's greedy tokens for PROMPT and their logprobs."""
    req = GenerateRequest(request_id=f"g-{torch.randint(1 << 30, ()).item()}",
                          prompt_token_ids=PROMPT,
                          sampling=SamplingOptions(max_tokens=n, temperature=0.0, logprobs=0,
                                                   ignore_eos=True))
    ids, lps = [], []
    async for ev in engine.generate(req, PROMPT):
        for c in ev.choices if type(ev) is Step else ():
            ids += c.token_ids
            lps += [lp.logprob for lp in c.logprobs or []]
    return ids, lps
