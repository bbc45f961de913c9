"""A staged version's shadow (rlfleet.vllm.shadow) lets its copy of the weights go as soon as
it is swapped in or discarded: by reference counting alone, not at the cyclic collector's
next full pass, which a serving engine may not run for many refreshes (each shadow kept is a
whole copy of the model: the engines' memory grew by one per staged refresh).

The shadow is built by vLLM's own in-place reload (the code the engine runs) over a small
torch model, in the engine's builder thread; the cyclic collector is off throughout."""

from __future__ import annotations

import gc
import os
import threading
import types
import weakref

import pytest
import torch

pytest.importorskip("vllm")
# at import, not inside a test: importing vLLM's loaders probes the platform with a process
from vllm.model_executor.model_loader.reload import (  # noqa: E402
    inplace,  # noqa: F401 - the loader Shadow imports in its builder thread
    layerwise,
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


CONFIG = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None,
                                                                  dtype=torch.float32),
                               load_config=None, lora_config=None)


def twin_tensors(shadow: Shadow) -> list[weakref.ref]:
    """The shadow's own tensors (with storage): its twins', or, for a layer the reload has
    not processed yet, the ones vLLM's reload keeps aside for it (on the layer: meta
    placeholders)."""
    out = {}
    for _, twin in shadow._pairs:
        info = layerwise.LAYERWISE_INFO.get(twin)
        aside = info.kernel_tensors if info is not None and info.kernel_tensors else ({}, {})
        for t in (*twin._parameters.values(), *twin._buffers.values(), *aside[0].values(),
                  *aside[1].values()):
            if t is not None and t.device.type != "meta":
                out[id(t)] = weakref.ref(t)
    return list(out.values())


@pytest.mark.parametrize("end", ["swap", "discard", "discard while built"])
def test_a_shadow_frees_its_copy_by_reference_counting(end, no_cyclic_gc) -> None:
    torch.manual_seed(0)
    model = Toy()
    layerwise.record_metadata_for_reloading(model)  # as vLLM does when it loads a model
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    reading, go = threading.Event(), threading.Event()

    def tensors():  # with "discard while built", the build waits after the first tensor
        for i, item in enumerate(new.items()):
            if i == 1 and end == "discard while built":
                reading.set()
                assert go.wait(30)
            yield item
    shadow = Shadow(model, CONFIG, "version", "digest", tensors())
    if end == "discard while built":
        assert reading.wait(30)
        copies = twin_tensors(shadow)
        shadow.discard()  # the engine let go of it (a newer version, a release)
        go.set()
        shadow.wait()
    else:
        shadow.wait()
        assert shadow.state == "ready", shadow.error
        copies = twin_tensors(shadow)
        shadow.swap() if end == "swap" else shadow.discard()
    assert copies
    held = weakref.ref(shadow)
    del shadow

    alive = sum(c() is not None for c in copies)
    assert alive == 0, f"{alive} of the shadow's {len(copies)} tensors are still alive"
    assert held() is None, "the shadow outlives its last reference (a reference cycle)"
    want = new if end == "swap" else old
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.embed.weight  # still tied


def test_the_builder_keeps_the_pages_a_shadow_freed_within_a_bound() -> None:
    """The builder thread allocates from a jemalloc arena of its own that keeps the pages it
    freed (the next build reuses them instead of faulting a model's worth of fresh pages in),
    until they pass the bound it is given before a build: then it purges them; the engine's
    other threads keep the default arenas."""
    import ctypes

    from rlfleet.vllm import shadow as sh

    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None or sh.KEEP_PAGES <= 0:
        pytest.skip("jemalloc is not the allocator of this process")

    def arena() -> int:
        v, size = ctypes.c_uint(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
        assert mallctl(b"thread.arena", ctypes.byref(v), ctypes.byref(size), None, 0) == 0
        return v.value

    def in_builder() -> tuple[int, int, bool, int, bool, int]:
        sh._builder_arena()
        t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, freed at once
        del t
        freed = sh.kept_bytes()
        kept = sh.bound_kept_pages(1 << 30)  # under the bound: kept
        after_keep = sh.kept_bytes()
        purged = sh.bound_kept_pages(16 << 20)  # over it: purged
        return arena(), freed, kept, after_keep, purged, sh.kept_bytes()
    index, freed, kept, after_keep, purged, after_purge = sh._BUILDER.submit(in_builder).result(30)
    assert index == sh._arena and arena() != index  # this thread: a default arena
    assert freed >= 64 << 20 and not kept and after_keep >= 64 << 20, (freed, after_keep)
    assert purged and after_purge < 16 << 20, after_purge


class Packing:
    """A quant method as the CPU build's unquantized one: processing packs the layer's
    weight into its `cpu_linear` (counted)."""

    def __init__(self) -> None:
        self.packed: list[torch.nn.Module] = []

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.packed.append(layer)
        w = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, w=w: x @ w.t()


class OtherPacking(Packing):
    pass


@pytest.mark.parametrize("case", ["tied", "untied", "another method", "no packing"])
def test_a_tied_output_layer_takes_the_embeddings_fresh_packing(case) -> None:
    """`refresh_tied_output` after a reload: an output layer tied to the embeddings (the
    same weight, the same kind of quant method, a CPU packing) takes the one the reload just
    made for the embeddings instead of packing the vocabulary's matrix again; any other
    output layer is processed again, as before."""
    from rlfleet.vllm.shadow import refresh_tied_output

    model = Toy()
    embed_qm, head_qm = Packing(), (OtherPacking() if case == "another method" else Packing())
    model.embed.quant_method, model.lm_head.quant_method = embed_qm, head_qm
    if case == "untied":
        model.lm_head.weight = torch.nn.Parameter(torch.randn(16, 8))
    head_qm.process_weights_after_loading(model.lm_head)  # as the engine loaded it
    head_qm.packed.clear()
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # the reload's new values, the embeddings packed anew
    embed_qm.process_weights_after_loading(model.embed)
    if case == "no packing":  # a GPU: nothing packed, the layer's own processing runs
        del model.embed.cpu_linear, model.lm_head.cpu_linear
    refresh_tied_output(model)
    x = torch.randn(3, 8)
    if case == "tied":
        assert head_qm.packed == [] and model.lm_head.cpu_linear is model.embed.cpu_linear
    else:
        assert head_qm.packed == [model.lm_head]
    if case != "no packing":  # the output layer computes with its weight's current values
        got = model.lm_head.cpu_linear(x, None, None)
        assert torch.equal(got, x @ model.lm_head.weight.detach().t())


def test_a_builder_thread_is_put_back_on_its_process_cores() -> None:
    """Intel OpenMP binds a thread to cores of its own choosing at its first parallel region;
    the builder puts itself back on its process's cores before each tensor."""
    from rlfleet.vllm.shadow import _on_the_process_cores

    cores = os.sched_getaffinity(os.getpid())
    if len(cores) < 2:
        pytest.skip("one core: no other binding to put back")
    seen: list[set[int]] = []

    def run() -> None:
        os.sched_setaffinity(0, {min(cores)})  # as the runtime binds it
        seen.append(os.sched_getaffinity(0))
        _on_the_process_cores()
        seen.append(os.sched_getaffinity(0))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [{min(cores)}, cores]


@pytest.mark.parametrize("free_gib, purged", [(3.0, True), (9.0, False)])
def test_kept_pages_go_back_to_a_host_short_of_memory(monkeypatch, free_gib, purged) -> None:
    """After a swap or a discard, the pages the builder keeps for its next build go back to
    the host when it could not hold another shadow of the model (4 GiB, 5 GiB with the
    margin) beside them; with room to spare they are kept."""
    from rlfleet.vllm import extension

    calls: list[int] = []
    monkeypatch.setattr(extension, "bound_kept_pages", lambda limit: calls.append(limit))
    monkeypatch.setattr(extension, "_available_host_memory", lambda: int(free_gib * 2**30))
    ext = extension.WorkerExtension.__new__(extension.WorkerExtension)
    ext.model_runner = types.SimpleNamespace(get_model=lambda: Toy())
    ext._rlfleet_release_if_short()
    assert calls == []  # no room check yet: the model's size is not known
    ext._rlfleet_shadow_bytes = 4 * 2**30
    ext._rlfleet_release_if_short()
    assert calls == ([0] if purged else [])
