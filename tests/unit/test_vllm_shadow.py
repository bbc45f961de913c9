"""A staged version's shadow (rlfleet.vllm.shadow) lets its copy of the weights go as soon as
it is swapped in or discarded: by reference counting alone, not at the cyclic collector's
next full pass, which a serving engine may not run for many refreshes (each shadow kept is a
whole copy of the model: the engines' memory grew by one per staged refresh).

The shadow is built by vLLM's own in-place reload (the code the engine runs) over a small
torch model, in the engine's builder thread; the cyclic collector is off throughout."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

pytest.importorskip("vllm")
# at import, not inside a test: importing vLLM's loaders probes the platform with a process
from vllm.model_executor.model_loader.reload import inplace  # noqa: E402, F401 - Shadow's loader
from vllm.model_executor.model_loader.reload.layerwise import (  # noqa: E402
    record_metadata_for_reloading,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

from rlfleet.vllm.shadow import Shadow  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.ones(8))


class Toy(torch.nn.Module):
    """An embedding tied to the output layer (as Qwen3's small models), two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, t)
        return set(params)


@pytest.fixture
def no_cyclic_gc():
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


@pytest.mark.parametrize("end", ["swap", "discard"])
def test_a_shadow_frees_its_copy_by_reference_counting(end, no_cyclic_gc) -> None:
    torch.manual_seed(0)
    model = Toy()
    record_metadata_for_reloading(model)  # as vLLM does when it loads a model
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None,
                                                                      dtype=torch.float32),
                                   load_config=None, lora_config=None)
    shadow = Shadow(model, config, "version", "digest", iter(list(new.items())))
    shadow.wait()
    assert shadow.state == "ready", shadow.error
    copies = [weakref.ref(t) for _, twin in shadow._pairs
              for t in (*twin._parameters.values(), *twin._buffers.values()) if t is not None]
    assert copies
    held = weakref.ref(shadow)
    shadow.swap() if end == "swap" else shadow.discard()
    del shadow

    alive = sum(c() is not None for c in copies)
    assert alive == 0, f"{alive} of the shadow's {len(copies)} tensors are still alive"
    assert held() is None, "the shadow outlives its last reference (a reference cycle)"
    want = new if end == "swap" else old
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.embed.weight  # still tied
