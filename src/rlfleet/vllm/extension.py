"""Methods mixed into vLLM's worker (`--worker-extension-cls`), reached through
`AsyncLLM.collective_rpc`. They run inside the engine's worker process, next to the model.

Engine facts that shape this code (see docs/engine-notes.md):
- the CPU build repacks linear layers, so the content digest is computed from the tensors
  handed to the loader, never from model.parameters();
- a tied output layer keeps a stale repacked copy after reload unless its
  process_weights_after_loading runs again;
- KV cache blocks written under weights that produced NaN poison later requests until the
  cache memory is cleared (rlfleet_clear_kv_cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch

from rlfleet.vllm.shadow import Shadow, bound_kept_pages, refresh_tied_output
from rlfleet.weights.digest import DigestBuilder, iter_checkpoint_tensors, non_finite

log = logging.getLogger("rlfleet.vllm.extension")

#: what a shadow must find free besides its own bytes (allocator slack, the tensors the
#: loader reads while it builds)
SHADOW_MARGIN = 1.25


def _available_host_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes (what the kernel could hand out without
    swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
            torch.int32, torch.int8, torch.uint8, torch.bool)}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def _prompt_logits_without_lora_rows() -> None:
    """vLLM's CPU LoRA kernels (punica_cpu `add_lora_logits`) index the output layer's LoRA
    by one row per sequence, and fail (killing the engine) on the prompt-logprobs path,
    which hands them one row per prompt token, as soon as two requests share a batch.
    rlfleet serves no adapter of the output layer or the embeddings (rlfleet.vllm.adapters
    refuses them), so that LoRA's weights are zero and adding them is nothing: on that path
    (rows that are not one per sequence) it is skipped, exactly."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:  # a build without the CPU wrapper
        return
    original = PunicaWrapperCPU.add_lora_logits
    if getattr(original, "rlfleet", False):
        return

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kw):
        rows = x.view(-1, x.shape[-1]).size(0)
        if rows != self.sampler_indices.size(0):
            if torch.count_nonzero(lora_b_stacked):
                raise RuntimeError("an adapter of the output layer is loaded: vLLM's CPU LoRA "
                                   "kernels cannot compute prompt logprobs with it")
            return None
        return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kw)
    add_lora_logits.rlfleet = True
    PunicaWrapperCPU.add_lora_logits = add_lora_logits


_prompt_logits_without_lora_rows()


class WorkerExtension:
    """Weight loading, identity and trainer → worker transfer for rlfleet."""

    def _rlfleet_apply(self, tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                       known_digest: str | None = None) -> dict:
        """Load (name, tensor) pairs in checkpoint format (`tensors()` gives them, and can
        be called twice). Returns {"digest"} of what was loaded (computed here, unless the
        caller computed it over the same bytes), or {"refused": why} with the live weights
        untouched: every value is checked finite before the model is. With `known_digest`
        (staged bytes: read-only files whose digest and finiteness rlfleet.weights.staging
        checked before they were READY) neither pass runs again inside the gated window."""
        digest = None
        if known_digest is None:
            digest = DigestBuilder()
            why = non_finite(tensors(), digest)
            if why:
                return {"refused": why}
        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        refresh_tied_output(self.model_runner.get_model())
        return {"digest": known_digest or digest.root()}

    def rlfleet_load_from_disk(self, path: str) -> dict:
        return self._rlfleet_apply(lambda: iter_checkpoint_tensors(path))

    def rlfleet_load_staged(self, path: str, digest: str) -> dict:
        """A staged version (rlfleet.weights.staging): read-only files whose digest was
        computed when they were staged (or while they were prepared, below). Swapped in when
        it was prepared, else reloaded in place."""
        shadow = getattr(self, "_rlfleet_shadow", None)
        if shadow is not None and (shadow.path, shadow.digest) == (path, digest):
            shadow.wait()
            if shadow.state == "ready":
                self._rlfleet_shadow = None
                t0 = time.perf_counter()
                shadow.swap()
                log.info("swapped in staged %s in %.3f s (prepared in %.2f s while serving)",
                         digest, time.perf_counter() - t0, shadow.seconds)
                self._rlfleet_release_if_short()
                return {"digest": digest, "swapped": True}
        self._rlfleet_discard()
        return self._rlfleet_apply(lambda: iter_checkpoint_tensors(path), known_digest=digest)

    def rlfleet_prepare_staged(self, path: str, digest: str | None,
                               checksums: dict[str, str] | None = None) -> bool:
        """Start reloading the version at `path` into a shadow of the model while the engine
        serves (rlfleet.vllm.shadow); one at a time, a newer one replaces it. `digest` None:
        the files are read once, each tensor hashed and checked as it is loaded (Adler-32 where
        `checksums` names one), and the digest is reported when it is built."""
        self._rlfleet_discard()
        self._rlfleet_shadow = Shadow(self.model_runner.get_model(), self.vllm_config, path,
                                      digest, iter_checkpoint_tensors(path), checksums)
        return True

    def _rlfleet_discard(self) -> None:
        """Drop the shadow held (a build under way drops it when it ends)."""
        shadow, self._rlfleet_shadow = getattr(self, "_rlfleet_shadow", None), None
        if shadow is not None:
            shadow.discard()
            self._rlfleet_release_if_short()

    def _rlfleet_release_if_short(self) -> None:
        """After a swap or a discard: the freed host pages the builder keeps for its next
        build (rlfleet.vllm.shadow.KEEP_PAGES) go back to the host when it could not hold
        another shadow of this model beside them. Another engine of the host cannot count
        them (its room check would refuse it a shadow), and two builds at once on top of
        them exhausted the host: two workers of the 1.7B geometry on 23 GiB, an engine core
        killed for memory (BENCHMARKS.md, "Refresh at model scale")."""
        nbytes = getattr(self, "_rlfleet_shadow_bytes", 0)
        if nbytes and next(self.model_runner.get_model().parameters()).device.type == "cpu" \
                and _available_host_memory() < nbytes * SHADOW_MARGIN:
            bound_kept_pages(0)

    def rlfleet_prepared(self, path: str, serving: bool = False) -> dict:
        """How the shadow of the version at `path` is coming along; `serving`: whether the
        engine serves requests now (the build yields the cores to them while it does)."""
        shadow = getattr(self, "_rlfleet_shadow", None)
        if shadow is None or shadow.path != path:
            return {"state": "none"}
        shadow.serving = serving
        out = {"state": shadow.state, "error": shadow.error, "seconds": shadow.seconds,
               "digest": shadow.digest, "bad_weights": shadow.bad_weights}
        if shadow.state == "failed":
            self._rlfleet_discard()
        return out

    def rlfleet_discard_staged(self, path: str) -> bool:
        shadow = getattr(self, "_rlfleet_shadow", None)
        if shadow is None or shadow.path != path:
            return False
        self._rlfleet_discard()
        return True

    def rlfleet_shadow_room(self, nbytes: int) -> str | None:
        """Why a shadow of `nbytes` does not fit next to the live model now (None: it fits),
        on the model's own device: free CUDA memory on a GPU, available host memory on CPU.
        A shadow being built or held is counted as freed (a new one replaces it)."""
        held = getattr(self, "_rlfleet_shadow", None)
        self._rlfleet_shadow_bytes = nbytes
        device = next(self.model_runner.get_model().parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            where = f"{device} has"
        else:
            free, where = _available_host_memory(), "the host has"
        if held is not None:
            free += nbytes
        need = int(nbytes * SHADOW_MARGIN)
        if free >= need:
            return None
        return (f"a shadow copy of the weights needs {need / 2**30:.2f} GiB ({nbytes / 2**30:.2f} "
                f"GiB and {SHADOW_MARGIN - 1:.0%} room); {where} {free / 2**30:.2f} GiB free")

    def rlfleet_weights_problem(self) -> str | None:
        """Why the model cannot run on its weights (None when it can), without running it:
        parameters left on the meta device by a load that failed half-way."""
        meta = [n for n, p in self.model_runner.get_model().named_parameters()
                if p.device.type == "meta"]
        if meta:
            return (f"{len(meta)} parameter(s) hold no data ({', '.join(meta[:3])}"
                    f"{', ...' if len(meta) > 3 else ''}): a weight load failed half-way")
        return None

    def rlfleet_clear_kv_cache(self) -> int:
        """Zero the KV cache memory (only while no request keeps KV in it: paused, with
        running requests reset). Returns the bytes cleared.

        Why: the attention kernels read whole cache blocks and mask the unused slots with
        zero weights, and 0 x NaN is NaN. Blocks written under weights that produced NaN or
        Inf keep poisoning later requests that reuse them, whatever the weights are by then,
        until the memory is cleared."""
        cleared = 0

        def clear(x) -> None:
            nonlocal cleared
            if isinstance(x, torch.Tensor):
                x.zero_()
                cleared += x.numel() * x.element_size()
            elif isinstance(x, (list, tuple)):
                for y in x:
                    clear(y)
        clear(getattr(self.model_runner, "kv_caches", []))
        return cleared

    # ------------------------------------------------------------ trainer → worker group

    def rlfleet_init_group(self, master_address: str, master_port: int, rank: int,
                           world_size: int, backend: str, timeout_s: float) -> bool:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rlfleet_destroy_group()
        self._rlfleet_device = "cuda" if backend == "nccl" else "cpu"
        self._rlfleet_group = stateless_init_torch_distributed_process_group(
            master_address, int(master_port), rank=int(rank), world_size=int(world_size),
            backend=backend, timeout=timedelta(seconds=timeout_s))
        self._rlfleet_staged: list[tuple[str, torch.Tensor]] = []
        return True

    def rlfleet_receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                        timeout_s: float) -> int:
        """Receive tensors broadcast by the trainer (rank 0) into staging buffers; live
        weights are untouched until rlfleet_apply_staged. Returns the bytes received."""
        group = getattr(self, "_rlfleet_group", None)
        if group is None:
            raise RuntimeError("no weight update group: call init_weights_update_group first")
        staged = []
        total = 0
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=dtype_from_name(dt), device=self._rlfleet_device)
            group.broadcast(t, 0, timedelta(seconds=timeout_s)).wait(timedelta(seconds=timeout_s))
            staged.append((name, t))
            total += t.numel() * t.element_size()
        self._rlfleet_staged = staged
        return total

    def rlfleet_apply_staged(self) -> dict:
        staged, self._rlfleet_staged = getattr(self, "_rlfleet_staged", []), []
        if not staged:
            raise RuntimeError("nothing staged to apply")
        return self._rlfleet_apply(lambda: iter(staged))

    def rlfleet_destroy_group(self) -> bool:
        group = getattr(self, "_rlfleet_group", None)
        self._rlfleet_group = None
        self._rlfleet_staged = []
        if group is not None:
            try:
                group.shutdown()
            except Exception as e:  # a broken group may not shut down cleanly
                log.warning("weight update group shutdown: %r", e)
        return group is not None
