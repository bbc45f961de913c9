"""A staged version prepared in the engine's own format while the engine serves, so that
applying it in the gated window is a copy and a few attribute swaps instead of a reload.

vLLM reloads a model in place layer by layer (model_loader/reload/layerwise.py): each
layer is put back in checkpoint format on the meta device, filled through its weight
loaders, processed (on CPU: linear weights repacked into the closures behind
`layer.cpu_linear`; tied output layer; attention scales) and its processed values copied
into the tensors the engine already holds. On the 0.6B geometry that is ~2 s on two cores,
all of it inside the gated window.

A `Shadow` does the same reload on a shadow tree while the live model serves: every module
shallow-copied (own parameter, buffer and child dicts), every live tensor cloned (tied
tensors stay tied), and each shadow layer given its own copy of the layer's reload
metadata (vLLM mutates those meta tensors in place: binding their weight loaders to the
layer and wrapping them; shared with the live layer they would route the next live reload
into the shadow). `swap()` then copies each processed tensor into the live tensor's
storage (references the engine holds, such as CUDA graphs, stay valid) and moves over the
attributes processing replaced (the repacked `cpu_linear` closures, attention scales).

Cost: a second copy of the model's weights on the engine's device from prepare to swap
(`--staged-apply reload` trades it back for the in-place reload)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Iterator
from types import MethodType

import torch

log = logging.getLogger("rlfleet.vllm.shadow")


#: every shadow is built in the same long-lived thread: the allocator (jemalloc on the CPU
#: build) keeps the memory a thread's arena freed for that arena, so a new thread per build
#: would leave the previous shadow's memory resident, a model's size per refresh
_BUILDER_NAME = "rlfleet-shadow"
#: the share of its thread's CPU time a shadow's build may take while the engine serves
#: requests (1: no pause); it only lengthens a preparation that runs off the critical path.
#: Two workers each pinned to one core, the 0.6B geometry: 0.2 kept 0.77 of their tokens/s
#: while both staged (a first build: 60 s), 0.3 kept 0.61 (a later build: 21 s)
SERVING_SHARE = float(os.environ.get("RLFLEET_STAGE_SERVING_SHARE", 0.2))
#: OpenMP threads of the builder's torch operations; unset: 1 when the model is on the CPU
#: (the build runs beside the engine's own serving threads and beside the other engines of
#: the host, on the same cores: two engines building at once on two cores, each with a team
#: of two, took ~30% longer in all, one of them starved), else the process's default
BUILD_THREADS = int(os.environ.get("RLFLEET_STAGE_BUILD_THREADS", 0))
#: how many copies of the model's weights the builder keeps of the host pages its builds
#: freed, for the next build (jemalloc, the CPU build's allocator: an arena of the builder's
#: own that never returns its freed pages to the system by itself; jemalloc's default 10 s
#: otherwise, after which every build faults a model's worth of fresh pages in again: its
#: copy of the live tensors, the CPU build's repacked weights). A build reuses most of them,
#: not all (~70 MB more a build on the 0.6B geometry), so before a build the arena is purged
#: whole once it keeps more than this. 0: the default arenas.
KEEP_PAGES = float(os.environ.get("RLFLEET_STAGE_KEEP_PAGES", 2))
_BUILDER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_BUILDER_NAME)
_arena: int | None = None  # the builder's own jemalloc arena, once made (-1: none)


def _mallctl():
    import ctypes

    return getattr(ctypes.CDLL(None), "mallctl", None)


def _builder_arena() -> None:
    """Give the builder thread an arena of its own that keeps its freed pages (once; none
    without jemalloc, or with RLFLEET_STAGE_KEEP_PAGES=0)."""
    global _arena
    if _arena is not None:
        return
    _arena = -1
    mallctl = _mallctl()
    if KEEP_PAGES <= 0 or mallctl is None:
        return
    import ctypes

    index, size = ctypes.c_uint(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
    if mallctl(b"arenas.create", ctypes.byref(index), ctypes.byref(size), None, 0) != 0:
        return
    never = ctypes.c_ssize_t(-1)
    for key in (b"dirty_decay_ms", b"muzzy_decay_ms"):
        mallctl(b"arena.%d.%s" % (index.value, key), None, None, ctypes.byref(never),
                ctypes.c_size_t(ctypes.sizeof(never)))
    if mallctl(b"thread.arena", None, None, ctypes.byref(index), size) == 0:
        _arena = index.value
        log.info("shadow builder: jemalloc arena %d keeps its freed pages", _arena)


def kept_bytes() -> int | None:
    """The freed pages the builder's arena keeps (None: no such arena, or no statistics)."""
    mallctl = _mallctl()
    if _arena is None or _arena < 0 or mallctl is None:
        return None
    import ctypes

    epoch = ctypes.c_uint64(1)  # statistics are read as of the last epoch: start one
    mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(8))
    pages, page = ctypes.c_size_t(), ctypes.c_size_t()
    size = ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    if mallctl(b"stats.arenas.%d.pdirty" % _arena, ctypes.byref(pages), ctypes.byref(size),
               None, 0) != 0 or mallctl(b"arenas.page", ctypes.byref(page), ctypes.byref(size),
                                        None, 0) != 0:
        return None
    return pages.value * page.value


def bound_kept_pages(limit: int) -> bool:
    """Purge the builder's arena when it keeps more than `limit` bytes of freed pages, or
    when it cannot tell (a week-long run's memory stays bounded); True when it did. Called
    in the builder thread before a build, and with 0 after a swap or a discard when the
    host is short of memory (rlfleet.vllm.extension)."""
    if _arena is None or _arena < 0:
        return False  # no arena of its own: jemalloc's default decay bounds it
    kept = kept_bytes()
    if kept is not None and kept <= limit:
        return False
    _mallctl()(b"arena.%d.purge" % _arena, None, None, None, 0)
    log.info("shadow builder: purged %s of freed pages (the bound: %.2f GiB)",
             "an unknown amount" if kept is None else f"{kept / 2**30:.2f} GiB", limit / 2**30)
    return True


def _builder_threads(model: torch.nn.Module) -> None:
    """Set the builder thread's own OpenMP team size (this thread's only: the engine's
    serving threads keep theirs)."""
    n = BUILD_THREADS
    if n <= 0:
        p = next(model.parameters(), None)
        n = 1 if p is not None and p.device.type == "cpu" else 0
    if n > 0:
        import ctypes

        set_threads = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
        if set_threads is not None:
            set_threads(n)


def _on_the_process_cores() -> None:
    """Put the calling thread back on the cores of its process (its main thread's). Intel
    OpenMP binds a thread that opens its first parallel region to cores of its own choosing
    (the mask the runtime read when it started, or one core of it), whatever the process was
    pinned to since: the two engines' builders of a two-core host, each engine pinned to its
    own core, both ran on one (builds ~2x as long), the other core idle."""
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            cores = os.sched_getaffinity(os.getpid())
            if os.sched_getaffinity(0) != cores:
                os.sched_setaffinity(0, cores)


class BadWeights(ValueError):
    """The version's tensors cannot be installed (non-finite values, a wrong checksum)."""

_OWN = ("_parameters", "_buffers", "_modules", "_do_torchao_reload", "_original_do_torchao_reload")


class Shadow:
    """A version reloaded into a shadow tree of `model`, built in a background thread.

    `digest`: the content digest of `tensors` when the caller computed it over the same
    bytes (a staged directory); None: each tensor is checked as the loader takes it (its
    digest, finite values, and its Adler-32 where `checksums` names one), in the same pass
    as the load, and `digest` is their root once built."""

    def __init__(self, model: torch.nn.Module, vllm_config, path: str, digest: str | None,
                 tensors: Iterator[tuple[str, torch.Tensor]],
                 checksums: dict[str, str] | None = None) -> None:
        self.model, self.path, self.digest = model, path, digest
        self.error: str | None = None
        self.bad_weights = False  # the error is about the weights, not this engine's room
        self.seconds = 0.0
        self._discarded = False
        self._building = True  # until the build ends (under _lock with _discarded)
        self._lock = threading.Lock()
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        #: whether the engine serves requests now (its owner says so as it polls): then the
        #: build takes at most SERVING_SHARE of its thread's CPU time, leaving the cores to them
        self.serving = False
        if digest is None:
            tensors = self._checked(tensors, checksums or {})
        self._built = _BUILDER.submit(self._build, vllm_config, self._paced(tensors))

    @property
    def state(self) -> str:
        if not self._built.done():
            return "building"
        return "failed" if self.error else "ready"

    def wait(self) -> None:
        """Until the build has finished (ready or failed)."""
        self._built.result()

    def _paced(self, tensors: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """`tensors` at the loader's pace, but while the engine serves, each one's work (its
        read and checks, and the loader's processing of the one before) is followed by a
        pause that keeps the build to SERVING_SHARE of the time: a shadow is prepared off
        the critical path, so it yields the cores to the requests (and releases the GIL)."""
        it = iter(tensors)
        t0 = time.thread_time()
        while True:
            item = next(it, None)
            if item is None:
                return
            # the CPU time this thread worked since its last pause (not the time that passed:
            # on a core it shares with the engine's serving thread, that counts their time too)
            if self.serving and SERVING_SHARE < 1.0:
                time.sleep((time.thread_time() - t0) * (1 - SERVING_SHARE) / SERVING_SHARE)
            _on_the_process_cores()
            t0 = time.thread_time()  # the loader's work on `item` counts towards the next
            yield item

    def _checked(self, tensors: Iterator[tuple[str, torch.Tensor]], checksums: dict[str, str]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """`tensors`, each one hashed, checked finite and against its Adler-32 (when given)
        as the loader takes it: one read of the checkpoint for all of it."""
        from rlfleet.weights.artifacts import adler32_hex
        from rlfleet.weights.digest import DigestBuilder, non_finite

        digests = DigestBuilder()
        for name, t in tensors:
            why = non_finite([(name, t)], digests)
            want = checksums.get(name)
            if why is None and want is not None:
                got = adler32_hex(t.contiguous().view(-1).view(torch.uint8).numpy())
                if got != want:
                    why = (f"tensor {name}: Adler-32 {got} does not match the artifact's {want} "
                           "(corrupt or changed since it was written)")
            if why is not None:
                raise BadWeights(why)
            yield name, t
        self.digest = digests.root()

    def _build(self, vllm_config, tensors) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        t0 = time.perf_counter()
        try:
            _builder_threads(self.model)
            _builder_arena()
            bound_kept_pages(int(KEEP_PAGES * sum(p.numel() * p.element_size()
                                                  for p in self.model.parameters())))
            with torch.no_grad():
                shadow = self._tree()
                reload_weights(vllm_config, shadow, weights_iterator=tensors, weights_path=None,
                               is_checkpoint_format=True)
                refresh_tied_output(shadow)
            if self.digest is None:
                raise BadWeights("the loader did not take every tensor of the version")
        except Exception as e:  # noqa: BLE001 - the caller says what happens instead
            self.error = f"{type(e).__name__}: {e}"
            self.bad_weights = isinstance(e, BadWeights)
            log.warning("preparing %s in the engine's format failed (%s)",
                        self.digest or self.path, self.error)
        self.seconds = time.perf_counter() - t0
        with self._lock:  # a discard asked for while it was built is done now
            self._building = False
            drop = self._discarded or self.error is not None
        if drop:
            self._drop()

    def _tree(self) -> torch.nn.Module:
        twins = _Twins()
        root = twins.module(self.model)
        self._pairs = twins.pairs
        return root

    def swap(self) -> None:
        """Install the shadow's processed state into the live model (the engine paused)."""
        if self.state != "ready" or self._discarded:
            raise RuntimeError(f"the prepared version is {self.state}: "
                               f"{self.error or 'discarded'}")
        done: set[int] = set()  # a tied tensor is copied once
        with torch.no_grad():
            for live, s in self._pairs:
                for table in ("_parameters", "_buffers"):
                    mine, theirs = getattr(live, table), getattr(s, table)
                    for k, t in mine.items():
                        n = theirs.get(k)
                        if t is None or n is None or n is t or id(t) in done:
                            continue
                        done.add(id(t))
                        if t.shape == n.shape and t.dtype == n.dtype:
                            t.data.copy_(n.data)
                        else:
                            t.data = n.data
                for k, v in s.__dict__.items():
                    if k not in _OWN and live.__dict__.get(k, _OWN) is not v:
                        live.__dict__[k] = v
        self.discard()

    def discard(self) -> None:
        """Let the shadow's tensors go (after the swap, or unused; a build under way lets
        them go when it ends). vLLM's reload keeps each layer's reload metadata in a
        weak-keyed table whose values refer back to the layer (bound weight loaders), so a
        shadow layer would outlive its tree, and every shadow its second copy of the
        weights: each twin's attributes are cleared (its tensors, the repacked weights the
        CPU build keeps beside them, its bound loaders) and its entry dropped."""
        with self._lock:
            self._discarded = True
            if self._building:
                return  # the build lets it go when it ends
        self._drop()

    def _drop(self) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        for _, s in self._pairs:
            layerwise.LAYERWISE_INFO.pop(s, None)
            s.__dict__.clear()
        self._pairs = []


class _Twins:
    """The shadow tree of a model: every module shallow-copied (own parameter, buffer and
    child dicts), every tensor cloned once (tied tensors stay tied), each layer's reload
    metadata copied and bound to its twin. `pairs`: (live, twin) for every module.

    A class, not nested functions: a nested function that calls itself holds itself in
    its closure, a reference cycle that only the cyclic collector frees, so every clone
    (a whole copy of the weights) would outlive the shadow until a full collection, which
    a serving engine may not run for many refreshes. Here the memo tables go with the
    instance as soon as the tree is built."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.modules: dict[int, torch.nn.Module] = {}
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []

    def tensor(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in self.tensors:
            if isinstance(t, torch.nn.Parameter):
                c = torch.nn.Parameter(t.data.clone(), requires_grad=False)
                c.__dict__.update(t.__dict__)
            else:
                c = t.clone()
            self.tensors[id(t)] = c
        return self.tensors[id(t)]

    @staticmethod
    def metadata(ts: dict[str, torch.Tensor], live: torch.nn.Module,
                 twin: torch.nn.Module) -> dict[str, torch.Tensor]:
        from vllm.model_executor.model_loader.reload import layerwise, meta

        out = {}
        for name, t in ts.items():
            m = meta.to_meta_tensor(t)
            if layerwise._get_weight_loader(m).__name__ == "online_process_loader":
                m.weight_loader = layerwise._get_original_loader(m)
            for k, v in list(m.__dict__.items()):
                if isinstance(v, MethodType) and v.__self__ is live:
                    m.__dict__[k] = v.__func__.__get__(twin)
            out[name] = m
        return out

    def module(self, m: torch.nn.Module) -> torch.nn.Module:
        from vllm.model_executor.model_loader.reload import layerwise

        if id(m) in self.modules:
            return self.modules[id(m)]
        s = copy.copy(m)
        self.modules[id(m)] = s
        self.pairs.append((m, s))
        s.__dict__["_parameters"] = {k: self.tensor(p) for k, p in m._parameters.items()}
        s.__dict__["_buffers"] = {k: self.tensor(b) for k, b in m._buffers.items()}
        s.__dict__["_modules"] = {k: None if c is None else self.module(c)
                                  for k, c in m._modules.items()}
        info = layerwise.LAYERWISE_INFO.get(m)
        if info is not None:
            twin = layerwise.get_layerwise_info(s)
            params, buffers = info.restore_metadata
            twin.restore_metadata = (self.metadata(params, m, s), self.metadata(buffers, m, s))
            twin.restore_device = info.restore_device
        return s


def refresh_tied_output(model: torch.nn.Module) -> None:
    """The CPU build keeps a stale repacked copy of an output layer tied to the input
    embeddings after a reload unless the layer is processed again (docs/engine-notes.md).
    The reload has just repacked the embeddings it is tied to (their weight, processed the
    same way): the output layer takes that packing instead of making its own, the
    vocabulary's matrix packed once a reload instead of twice (~0.3 s of the 0.6B geometry's
    ~1.7 s of repacking on one core)."""
    lm_head = getattr(model, "lm_head", None)
    qm = getattr(lm_head, "quant_method", None)
    if qm is None or not hasattr(qm, "process_weights_after_loading"):
        return
    weight = getattr(lm_head, "weight", None)
    tied = next((m for m in model.modules() if m is not lm_head and weight is not None
                 and getattr(m, "weight", None) is weight
                 and type(getattr(m, "quant_method", None)) is type(qm)
                 and "cpu_linear" in m.__dict__), None)
    if tied is not None and "cpu_linear" in lm_head.__dict__:
        lm_head.cpu_linear = tied.cpu_linear
    else:
        qm.process_weights_after_loading(lm_head)
