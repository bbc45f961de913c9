"""The vLLM engine (AsyncLLM) behind the worker contract."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.protocol.admin_vllm import DistributedRequest, GroupRequest
from rlfleet.protocol.engine import (
    Delta,
    Done,
    GenerateRequest,
    PromptLogprob,
    SamplingOptions,
    Step,
    TokenLogprob,
)
from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.runtime.progress import Progress
from rlfleet.runtime.routed_experts import from_array
from rlfleet.vllm.adapters import LoraAdapters, Served
from rlfleet.weights.artifacts import ArtifactError
from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature, signature_mismatch
from rlfleet.worker.engine import (
    AppliedWeights,
    BadRequest,
    Engine,
    EngineControl,
    EngineInfo,
    PreparedVersion,
    WeightLoadError,
)

log = logging.getLogger("rlfleet.vllm")

LOAD_TIMEOUT = float(os.environ.get("RLFLEET_LOAD_TIMEOUT", 600))
HEALTH_TIMEOUT = 10.0  # seconds the engine has to answer a liveness check
# staged tensors cross into the engine process as a safetensors file in memory (tmpfs)
_STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
# vLLM's CPU platform sets this to "spawn" for every engine, so that the engine-core process
# imports vLLM and torch afresh (~7.6 CPU-s and ~7.5 s of a tiny model's start on 2 cores,
# bench/engine_threads.py). A CPU worker (`python -m rlfleet.vllm`) forks its engine core
# instead, as vLLM does by default elsewhere: the worker holds rlfleet's modules only and
# has loaded no model. The fork keeps the worker's CPUs (Intel OpenMP pins a forked child
# to the first one: two workers' engines then took turns on one core,
# `keep_cpus_in_forked_children`). An engine embedded in another process (a test's, a
# trainer's) is still spawned: a fork would copy that process's modules into the engine
# core, and vLLM's kernel registration walks them (AReaL's werkzeug proxies raise there).
# Set the variable to "spawn" to keep vLLM's choice; a GPU engine is left to vLLM.
START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"

def pin_to_cores(world_size: int) -> list[int] | None:
    """A CPU engine of one rank runs on the cores CPU_BIND lists (`rlfleet up` gives each
    worker of a host its own, rlfleet.runtime.launch.cpu_shares): every thread of
    this process, and the engine core it starts, with an OpenMP team as wide as the list.
    vLLM binds each rank of a parallel CPU engine so (its multiprocessing executor) but
    nothing for a single rank. None: nothing pinned (unset, "auto", "nobind", several ranks)."""
    from rlfleet.runtime.launch import CPU_BIND

    raw = os.environ.get(CPU_BIND, "").strip()
    if raw in ("", "auto", "nobind") or "|" in raw or world_size > 1:
        return None
    from vllm.utils.cpu_resource_utils import parse_id_list

    try:
        cores = parse_id_list(raw)
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as e:
        raise ValueError(f"{CPU_BIND}={raw!r}: not a list of this host's CPUs this worker "
                         f"may use ({sorted(os.sched_getaffinity(0))}, as 0-3,6): {e}") from None
    for tid in os.listdir("/proc/self/task"):  # the threads started already (an OpenMP team)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)
    import torch

    torch.set_num_threads(len(cores))
    os.environ["OMP_NUM_THREADS"] = str(len(cores))  # the engine core's team
    log.info("pinned to cores %s (%s)", raw, CPU_BIND)
    return cores


try:  # vLLM's validation errors are not all ValueErrors
    from vllm.exceptions import VLLMClientError

    _CLIENT_ERRORS: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
except ImportError:  # older vLLM
    _CLIENT_ERRORS = (ValueError,)


def _structured(s: SamplingOptions):
    """vLLM's StructuredOutputsParams from the request's `structured_outputs` and
    `response_format`, read with vLLM's own request models and checks."""
    if s.structured_outputs is None and s.response_format is None:
        return None
    from pydantic import TypeAdapter, ValidationError
    from vllm.entrypoints.generate.base.protocol import (
        AnyResponseFormat,
        structured_outputs_from_response_format,
        validate_structural_tag_response_format,
        validate_structured_outputs_structural_tag,
    )
    from vllm.sampling_params import StructuredOutputsParams

    try:
        so = rf = None
        if s.structured_outputs is not None:
            so = TypeAdapter(StructuredOutputsParams).validate_python(s.structured_outputs)
            if sum(getattr(so, k, None) is not None for k in ("json", "regex", "choice")) > 1:
                raise ValueError("You can only use one kind of constraints for structured "
                                 "outputs ('json', 'regex' or 'choice').")
            validate_structured_outputs_structural_tag(so)
        if s.response_format is not None:
            rf = TypeAdapter(AnyResponseFormat).validate_python(s.response_format)
            if rf.type == "json_schema" and getattr(rf, "json_schema", None) is None:
                raise ValueError("When response_format type is 'json_schema', the 'json_schema' "
                                 "field must be provided.")
            if rf.type == "structural_tag":
                validate_structural_tag_response_format(s.response_format)
        return structured_outputs_from_response_format(so, rf)
    except (ValidationError, ValueError, TypeError) as e:
        raise BadRequest(f"structured outputs: {e}") from e


def _experts_start(req: GenerateRequest, prompt_len: int) -> int | None:
    """vLLM's routed_experts_prompt_start for the request (None: not asked): -1 is the last
    prompt position (one row per completion token), as vLLM checks it."""
    start = req.routed_experts_start
    if start is None:
        return None
    start = prompt_len - 1 if start == -1 else start
    if not 0 <= start <= prompt_len:
        raise BadRequest(f"routed_experts_prompt_start must be between 0 and the prompt "
                         f"length {prompt_len}, got {start}")
    return start


def _sampling_params(s: SamplingOptions, room: int, stream: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0), min_p=s.min_p,
        seed=s.seed, max_tokens=s.max_tokens or room, min_tokens=s.min_tokens,
        stop=s.stop or None, stop_token_ids=s.stop_token_ids or None, ignore_eos=s.ignore_eos,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias,
        allowed_token_ids=s.allowed_token_ids, bad_words=s.bad_words or None,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        stream_interval=s.stream_interval, structured_outputs=_structured(s),
        watermarking=s.watermarking,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


def _token_logprobs(token_ids, logprobs, k: int) -> list[TokenLogprob]:
    """vLLM's per-position {token_id: Logprob} dicts → TokenLogprobs, 1:1 with token_ids."""
    out = []
    for tid, pos in zip(token_ids, logprobs, strict=True):
        chosen = pos[tid]
        top = []
        if k > 0:
            ranked = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = [(t, lp.logprob, lp.decoded_token or "") for t, lp in ranked[:k]]
        out.append(TokenLogprob(token_id=tid, logprob=chosen.logprob, rank=chosen.rank,
                                decoded=chosen.decoded_token or "", top=top))
    return out


def _prompt_logprobs(prompt_ids: list[int], prompt_logprobs
                     ) -> list[dict[str, PromptLogprob] | None]:
    """The contract's shape: position 0 null, then {"<id>": PromptLogprob}."""
    out: list[dict[str, PromptLogprob] | None] = []
    for i, pos in enumerate(prompt_logprobs):
        if pos is None or i == 0:
            out.append(None)
            continue
        entries = {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                         decoded_token=lp.decoded_token or "")
                   for t, lp in pos.items()}
        if str(prompt_ids[i]) not in entries:  # never expected; keep alignment honest
            raise RuntimeError(f"engine returned no logprob for prompt token at position {i}")
        out.append(entries)
    return out


class _PromptLogprobs:
    """One request's prompt logprobs, gathered from its RequestOutputs: with DELTA outputs
    vLLM sends each part once (today all of them with the first token, at the end of the
    prefill) and `[]` in every output after; FINAL_ONLY sends them in its one output.
    `ready` once they cover the prompt (converted by `_prompt_logprobs`); `take()` hands
    them out once: an event after that carries none, rather than an empty list."""

    __slots__ = ("ids", "parts", "ready", "taken")

    def __init__(self, prompt_ids: list[int]) -> None:
        self.ids = prompt_ids
        self.parts: list = []  # vLLM's per-position entries so far (position 0: None)
        self.ready: list[dict[str, PromptLogprob] | None] | None = None
        self.taken = False

    def add(self, part) -> None:
        if not part or self.ready is not None:
            return
        self.parts.extend(part)
        if len(self.parts) > len(self.ids):
            raise RuntimeError(f"engine returned {len(self.parts)} prompt logprobs for a "
                               f"prompt of {len(self.ids)} tokens")
        if len(self.parts) == len(self.ids):
            self.ready = _prompt_logprobs(self.ids, self.parts)

    def take(self) -> list[dict[str, PromptLogprob] | None] | None:
        if self.taken or self.ready is None:
            return None
        self.taken = True
        return self.ready


def _span(w) -> WeightSpan:
    """vLLM's WeightVersionSpan (labelled with `PolicyIdentity.span_label` by set_version)
    → a WeightSpan ({"version", "digest", "step", "start", "end"} on the wire)."""
    return WeightSpan.of(PolicyIdentity.from_span_label(w.version), w.start, w.end)


async def _until_listening(host: str, port: int, deadline: float) -> None:
    """Return once host:port accepts a TCP connection (closed at once); TimeoutError at the
    deadline, saying what did not answer."""
    last: Exception | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), left)
        except (OSError, TimeoutError) as e:
            last = e
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        writer.close()
        return
    raise TimeoutError(f"the trainer's rendezvous at {host}:{port} accepted no connection in "
                       f"time ({last!r})")


class VllmEngine(Engine, EngineControl):
    def __init__(self, args: argparse.Namespace, fork_core: bool = False) -> None:
        """`fork_core`: on a CPU, fork the engine-core process from this one (START_METHOD);
        only for a process of rlfleet's own (the worker's main), never an embedding one."""
        self.args = args
        self.fork_core = fork_core
        self.llm = None
        self.tokenizer = None
        self._running = 0
        from rlfleet.vllm.args import served_name, weight_transfer_backend

        path = Path(args.model)
        name = served_name(args)
        self.version: str | None = None  # caller-declared weight version
        self.version_declared = False
        self.digest: str | None = None  # content digest of the weights applied
        self.step: int | None = None  # the policy's fleet step, when declared
        self.weights_path: str | None = None  # where the live weights were read from
        self.signature: dict = {}  # tensor name -> (dtype, shape) the model accepts
        self.weights_bytes = 0  # the checkpoint's tensor bytes (a shadow copy's size)
        self.on_gpu = False
        self._calls: dict[object, tuple[str, float]] = {}  # engine RPCs in flight (busy)
        self.traced = False  # vLLM traces requests (it was given an OTLP endpoint)
        self.lora: LoraAdapters | None = None  # with --enable-lora
        self._bound: dict[str, PolicyIdentity] = {}  # request id -> its adapter's version
        self.info = EngineInfo(served_model_name=name, model_path=str(path.resolve()) if path.exists()
                               else args.model, vocab_size=0, max_model_len=0,
                               weight_transfer_backend=weight_transfer_backend(args),
                               logprobs_mode=str(getattr(args, "logprobs_mode", None) or "")
                               or None, tokenizer=getattr(args, "tokenizer", None))

    def engine_args(self):
        """vLLM's AsyncEngineArgs from the worker's command line (rlfleet.vllm.args)."""
        from rlfleet.vllm.args import engine_args

        return engine_args(self.args)

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        from rlfleet.runtime.launch import (
            children_die_with_this_process,
            keep_cpus_in_forked_children,
        )

        if not children_die_with_this_process():
            log.warning("setpriv (util-linux) not found: if this worker is killed, its engine "
                        "process may outlive it")
        size = sum(f.stat().st_size for f in Path(self.args.model).glob("*.safetensors")) \
            if Path(self.args.model).is_dir() else None
        loading = Progress(f"loading {self.args.model} into vLLM", size, heartbeat=True)
        try:
            # as `vllm serve` makes its engine (AsyncLLM.from_engine_args, with the start
            # method below): the batch defaults (max_num_seqs, max_num_batched_tokens) are
            # chosen by this context, per device
            engine_args = self.engine_args()
            asked = os.environ.get(START_METHOD)
            config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
            if config.device_config.device_type == "cpu":
                pin_to_cores(config.parallel_config.world_size)
            if self.fork_core and config.device_config.device_type == "cpu" \
                    and asked != "spawn":
                os.environ[START_METHOD] = "fork"  # see START_METHOD
                keep_cpus_in_forked_children()
            self.llm = AsyncLLM(vllm_config=config, executor_class=Executor.get_class(config),
                                log_requests=engine_args.enable_log_requests,
                                log_stats=not engine_args.disable_log_stats,
                                usage_context=UsageContext.OPENAI_API_SERVER)
        except BaseException as e:
            loading.fail(repr(e))
            raise
        loading.finish()
        self.weights_bytes = size or 0
        mc = self.llm.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.info.vocab_size = mc.get_vocab_size()
        self.info.max_model_len = mc.max_model_len
        self.info.logprobs_mode = str(mc.logprobs_mode)  # as the engine resolved it
        self.info.eos_token_ids = (eos,) if eos is not None else ()
        self.info.world_size = self.llm.vllm_config.parallel_config.world_size_across_dp
        self.info.kv_block_size = self.llm.vllm_config.cache_config.block_size
        events = self.llm.vllm_config.kv_events_config  # --kv-events-config
        if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
            self.info.kv_events = events.endpoint
        self.on_gpu = self.llm.vllm_config.device_config.device_type == "cuda"
        self.traced = self.llm.observability_config.otlp_traces_endpoint is not None
        if Path(self.args.model).is_dir():
            self.weights_path = str(Path(self.args.model).resolve())
            self.signature = checkpoint_signature(Path(self.weights_path))
            self.digest = checkpoint_digest(Path(self.weights_path))
        await self.set_version(None, declared=False)
        await self._start_adapters()
        if self.args.warmup:
            with Progress("warm-up request (compiles the logprobs kernels)"):
                await self._warmup()

    def serving_policy(self) -> PolicyIdentity:
        return PolicyIdentity(version=self.version, digest=self.digest, step=self.step)

    def request_policy(self, req: GenerateRequest) -> PolicyIdentity:
        if req.adapter is None:
            return self.serving_policy()
        return self._bound.get(req.request_id) or self._lora().policy_of(req.adapter)

    # ------------------------------------------------------------ LoRA adapters

    async def _start_adapters(self) -> None:
        lc = self.llm.vllm_config.lora_config
        if lc is None:
            return
        self.lora = LoraAdapters(self.llm, self.signature, lc.max_loras, lc.max_lora_rank)
        for m in self.args.lora_modules or []:
            await self.lora.load(m.name, Path(m.path).resolve(), None, None)

    loads_adapters_beside = True  # a new vLLM adapter id per version (rlfleet.vllm.adapters)

    async def _warmup(self) -> None:
        """The first request that asks for logprobs compiles a kernel: pay for it now."""
        req = GenerateRequest(request_id="warmup", prompt_token_ids=[1, 2, 3],
                              sampling=SamplingOptions(max_tokens=4, logprobs=1, prompt_logprobs=1,
                                                       ignore_eos=True, n=2))
        async for _ in self.generate(req, [1, 2, 3]):
            pass

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    def tokenize(self, prompt=None, messages=None, add_generation_prompt=True,
                 chat_template_kwargs=None, add_special_tokens=None) -> list[int]:
        if messages is not None:
            kwargs = dict(chat_template_kwargs or {})
            kwargs.setdefault("add_generation_prompt", add_generation_prompt)
            if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt"):
                raise BadRequest("continue_final_message and add_generation_prompt are not "
                                 "compatible: set add_generation_prompt to false to continue "
                                 "the final message")
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            except Exception as e:
                raise BadRequest(f"cannot render these messages with the chat template: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
        return self.tokenizer.encode(
            prompt, add_special_tokens=True if add_special_tokens is None else add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def num_running(self) -> int:
        return self._running

    async def generate(self, req: GenerateRequest, prompt_token_ids: list[int]
                       ) -> AsyncIterator[Step | Done]:
        from vllm.inputs import TokensPrompt

        s = req.sampling
        room = self.info.max_model_len - len(prompt_token_ids)
        try:
            sp = _sampling_params(s, room, req.stream)
        except _CLIENT_ERRORS as e:  # vLLM's own checks of the sampling parameters
            raise BadRequest(str(e)) from e
        k = s.logprobs or 0
        experts_from = _experts_start(req, len(prompt_token_ids))
        if experts_from is not None:  # returned by an engine with --enable-return-routed-experts
            sp.routed_experts_prompt_start = experts_from
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        # the engine's own span (vLLM traces when it has an OTLP endpoint) joins the request's
        trace = {"traceparent": req.traceparent} if req.traceparent and self.traced else None
        served = self._lora().bind(req.adapter) if req.adapter is not None else None
        if served is not None:
            self._bound[req.request_id] = served.policy
        try:
            results = self.llm.generate(prompt, sp, req.request_id, priority=req.priority,
                                        session_id=req.session_id, trace_headers=trace,
                                        lora_request=served.lora if served else None)
        except BaseException:
            self._unbind(req, served)
            raise
        prompt_lps = _PromptLogprobs(prompt_token_ids)
        early = req.echo and req.stream  # prompt logprobs go in the first event (see Head)
        started = False
        self._running += 1
        series = self.series
        series.running.inc()
        series.prompt.inc(len(prompt_token_ids))
        cached = None  # prompt tokens vLLM found in its prefix cache
        try:
            async for out in results:
                started = True
                prompt_lps.add(out.prompt_logprobs)
                cached = getattr(out, "num_cached_tokens", cached)
                choices = []
                for c in out.outputs:
                    ids = list(c.token_ids)
                    if not ids and c.finish_reason is None:
                        continue
                    series.generated.inc(len(ids))
                    choice = Delta(
                        index=c.index, token_ids=ids, text=c.text,
                        logprobs=_token_logprobs(ids, c.logprobs, k)
                        if s.logprobs is not None and c.logprobs is not None else None,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    if c.weight_versions and served is None:  # the base model's spans
                        choice.weight_versions = [_span(w) for w in c.weight_versions]
                    if experts_from is not None and c.finish_reason is not None \
                            and getattr(c, "routed_experts", None) is not None:
                        choice.routed_experts = from_array(np.asarray(c.routed_experts),
                                                                 experts_from)
                    choices.append(choice)
                if choices:
                    ev = Step(choices=choices)
                    if early and prompt_lps.ready is not None:
                        ev.prompt_logprobs, early = prompt_lps.take(), False
                    yield ev
            done = Done(prompt_logprobs=prompt_lps.take())
            if isinstance(cached, int):
                done.cached_tokens = cached
            yield done
        except _CLIENT_ERRORS as e:
            if not started:  # vLLM's input checks
                raise BadRequest(str(e)) from e
            raise
        finally:
            self._running -= 1
            series.running.dec()
            self._unbind(req, served)
            await results.aclose()

    def _unbind(self, req: GenerateRequest, served: Served | None) -> None:
        if served is not None:
            self._bound.pop(req.request_id, None)
            self.lora.release(served)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def tracks(self, request_id: str) -> bool:
        return request_id in self.llm.output_processor.external_req_ids

    async def abort_all(self) -> int:
        """Every request vLLM tracks (parallel-sampling parents too), by its internal id, as
        vLLM's own /abort_requests does."""
        op = self.llm.output_processor
        ids = [*op.request_states.keys(), *op.parent_requests.keys()]
        await self.llm.abort(ids, internal=True)
        return len(ids)

    def world_size(self, include_dp: bool = True) -> int:
        pc = self.llm.vllm_config.parallel_config
        return pc.world_size_across_dp if include_dp else pc.world_size

    # ------------------------------------------------------------ control (EngineControl)

    @property
    def group_backend(self) -> str:
        return "nccl" if self.on_gpu else "gloo"

    async def _rpc(self, method: str, timeout: float, *args: Any) -> Any:
        """Call a WorkerExtension method inside the engine process (one worker: rank 0). The
        engine runs it between steps, so a long one stalls generation: `busy` tells."""
        key = object()
        self._calls[key] = (method, time.monotonic())
        try:
            out = await asyncio.wait_for(
                self.llm.collective_rpc(method, timeout=timeout, args=args), timeout + 5)
        finally:
            del self._calls[key]
        return out[0]

    def busy(self) -> str | None:
        if not self._calls:
            return None
        method, t0 = min(self._calls.values(), key=lambda c: c[1])
        return f"{method.removeprefix('rlfleet_')} running for {time.monotonic() - t0:.1f}s"

    async def check_health(self) -> None:
        await asyncio.wait_for(self.llm.check_health(), HEALTH_TIMEOUT)

    async def weights_problem(self) -> str | None:
        return await self._rpc("rlfleet_weights_problem", HEALTH_TIMEOUT)

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def is_paused(self) -> bool:
        return await self.llm.is_paused()

    async def reset_cache(self, running: bool = False) -> bool:
        """With `running` while paused (after a weight load), the cache memory is cleared
        too: KV written under weights that produced NaN would poison later requests
        (rlfleet.vllm.extension.WorkerExtension.rlfleet_clear_kv_cache)."""
        if not await self.llm.reset_prefix_cache(reset_running_requests=running):
            return False
        if running and await self.is_paused():
            await self._rpc("rlfleet_clear_kv_cache", LOAD_TIMEOUT)
        return True

    def applied(self) -> AppliedWeights:
        dtype = str(self.llm.model_config.dtype).removeprefix("torch.") if self.llm else None
        return AppliedWeights(self.serving_policy(), self.version_declared, dtype)

    async def set_version(self, version: str | None, declared: bool = True,
                          digest: str | None = None, step: int | None = None) -> None:
        """Record the weight identity; the engine stamps it on the tokens it samples."""
        self.version, self.version_declared = version, declared
        if digest is not None:
            self.digest, self.step = digest, step
        elif step is not None:
            self.step = step
        await self.llm.update_weight_version(self.serving_policy().span_label())

    def checkpoint_mismatch(self, path: Path) -> str | None:
        from safetensors import SafetensorError

        try:
            got = checkpoint_signature(path)
        except (SafetensorError, OSError) as e:  # truncated, not safetensors, unreadable
            raise ValueError(f"checkpoint {path} is not readable safetensors: {e}") from e
        return signature_mismatch(self.signature, got)

    async def _load(self, method: str, *args: Any) -> str:
        """Load through the worker extension; after a failure, the previous weights back
        (WeightLoadError.uncertain when they could not be)."""
        try:
            out = await self._rpc(method, LOAD_TIMEOUT, *args)
        except Exception as e:
            restored, how = await self._restore()
            if not restored:  # part of each, or nothing: no identity may be reported for it
                await self._forget_identity()
            raise WeightLoadError(f"{e!r}; {how}", uncertain=not restored) from e
        if "refused" in out:  # checked before the model was touched
            raise WeightLoadError(f"{out['refused']}; nothing was changed: the previous weights "
                                  "are still serving")
        return out["digest"]

    async def _forget_identity(self) -> None:
        """The weights are uncertain: get_weight_version, discovery and every token's span
        report no version, digest or step until a load succeeds (they reported the previous
        weights' before: issue 43)."""
        self.version, self.version_declared, self.digest, self.step = None, False, None, None
        try:
            await self.llm.update_weight_version(self.serving_policy().span_label())
        except Exception as e:  # noqa: BLE001 - the engine may be the thing that failed
            log.warning("could not clear the served weight label: %r", e)

    async def _restore(self) -> tuple[bool, str]:
        """Put the previous weights back after a failed load: (whether they are, how)."""
        if self.weights_path is None:
            return False, ("the previous weights came from memory (a trainer or staged tensors) "
                           "and cannot be re-read: load a checkpoint, or replace this worker")
        try:
            out = await self._rpc("rlfleet_load_from_disk", LOAD_TIMEOUT, self.weights_path)
        except Exception as e:
            log.error("restoring %s failed: %r", self.weights_path, e)
            return False, (f"restoring the previous weights from {self.weights_path} also "
                           "failed: load a checkpoint, or replace this worker")
        if out.get("digest") != self.digest:
            return False, (f"the weights now at {self.weights_path} are not the previous ones "
                           f"({out.get('refused') or out.get('digest')}): load a checkpoint, "
                           "or replace this worker")
        await self.reset_cache(running=True)
        return True, "the previous weights were restored"

    async def load_path(self, path: Path) -> str:
        digest = await self._load("rlfleet_load_from_disk", str(path))
        self.weights_path = str(path)
        return digest

    async def apply_tensors(self, tensors: Mapping[str, Any]) -> str:
        from safetensors.torch import save_file

        sig = {n: (str(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        why = signature_mismatch(self.signature, sig)
        if why:
            raise ValueError(f"the staged tensors do not fit the served model: {why}")
        staging = Path(tempfile.mkdtemp(prefix="rlfleet-apply-", dir=_STAGING_DIR))
        try:
            seen: set[int] = set()
            flat = {}
            for name, t in tensors.items():  # a tied output layer may share storage
                t = t.detach().contiguous()
                ptr = t.untyped_storage().data_ptr()
                flat[name] = t.clone() if ptr in seen else t
                seen.add(ptr)
            await asyncio.to_thread(save_file, flat, str(staging / "model.safetensors"))
            digest = await self._load("rlfleet_load_from_disk", str(staging))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.weights_path = None
        return digest

    async def staging_refusal(self) -> str | None:
        if self.args.staged_apply != "swap":
            return ("this worker was started with --staged-apply reload: a staged version is "
                    "reloaded in place, inside the pause")
        if not self.weights_bytes:
            return "the size of this worker's weights is not known (it was not started from a "\
                   "checkpoint directory)"
        return await self._rpc("rlfleet_shadow_room", 30, self.weights_bytes)

    async def prepare_staged(self, path: Path, digest: str | None,
                             checksums: Mapping[str, str] | None = None
                             ) -> PreparedVersion | None:
        """With --staged-apply swap: the engine reloads the version into a shadow of the
        model in a thread while it serves (rlfleet.vllm.shadow); load_staged then swaps it
        in. A preparation that failed for want of room is logged (None: the load reloads in
        place); one that failed on the tensors raises ArtifactError."""
        if self.args.staged_apply != "swap":
            return None
        await self._rpc("rlfleet_prepare_staged", 30, str(path), digest,
                        dict(checksums) if checksums else None)
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            out = await self._rpc("rlfleet_prepared", 30, str(path), self._running > 0)
            if out["state"] != "building" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        if out["state"] != "ready":
            if out.get("bad_weights"):
                raise ArtifactError(out["error"])
            log.warning("%s was not prepared in the engine's format (%s)", path,
                        out.get("error") or out["state"])
            await self.discard_staged(path)
            return None
        log.info("staged %s prepared in the engine's format in %.2f s", out["digest"],
                 out["seconds"])
        return PreparedVersion("swap", out["digest"], out["seconds"])

    async def discard_staged(self, path: Path) -> None:
        await self._rpc("rlfleet_discard_staged", 30, str(path))

    async def load_staged(self, path: Path, digest: str) -> str:
        """The engine reads the staged files in place (shared memory); their digest was
        computed over the same bytes when they were staged, so it is not computed again
        inside the gated window. The files are the resident copy from now on: a failed
        later load restores from them."""
        why = self.checkpoint_mismatch(path)
        if why:
            raise WeightLoadError(f"the staged tensors do not fit the served model: {why}; the "
                                  "previous weights are still serving")
        loaded = await self._load("rlfleet_load_staged", str(path), digest)
        self.weights_path = str(path)
        return loaded

    def announced_mismatch(self, d: DistributedRequest) -> str | None:
        sig = {n: ("", tuple(s)) for n, s in zip(d.names, d.shapes, strict=True)}
        why = signature_mismatch(self.signature, sig)
        return f"the announced tensors do not fit the served model: {why}" if why else None

    async def join_group(self, g: GroupRequest) -> None:
        """Within `g.timeout`: torch's rendezvous takes about twice its timeout to give up
        on a port nobody listens on, and blocks the engine's loop all along. So wait here
        (the engine serving meanwhile) until the trainer's rendezvous accepts connections,
        then join with the time left."""
        deadline = time.monotonic() + g.timeout
        await _until_listening(g.master_address, g.master_port, deadline)
        left = max(1.0, deadline - time.monotonic())
        await self._rpc("rlfleet_init_group", left + 5, g.master_address, g.master_port,
                        g.rank_offset, g.world_size, g.backend, left)

    async def receive(self, d: DistributedRequest, timeout: float) -> int:
        return await self._rpc("rlfleet_receive", timeout * len(d.names) + 5, d.names, d.dtypes,
                               d.shapes, timeout)

    async def apply_received(self) -> str:
        digest = await self._load("rlfleet_apply_staged")
        self.weights_path = None
        return digest

    def own_transfer_backend(self) -> str | None:
        from rlfleet.vllm.args import own_transfer_backend

        return own_transfer_backend(self.args)

    def weight_transfer_refusal(self) -> str | None:
        if self.on_gpu:
            return None  # vLLM says what is missing (e.g. no --weight-transfer-config)
        return ("vLLM's weight-transfer backends (nccl, ipc and the others it registers) need "
                "a GPU, and this worker runs vLLM's CPU build (RLFLEET_ENGINE=cpu): start it "
                "with --weight-transfer-config '{\"backend\": \"modelexpress\"}' to take "
                "ModelExpress versions from object storage through these routes, or load "
                "weights with POST /collective_rpc {\"method\": \"reload_weights\"}, "
                "/engine/update_weights_from_disk or /engine/init_weights_update_group (gloo)")

    async def transfer_weights(self, step: str, payload: Any = None) -> None:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        llm = self.llm
        if step == "init":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payload))
        elif step == "update":
            await llm.update_weights(request=WeightTransferUpdateRequest(update_info=payload))
        elif step == "start":
            await llm.start_weight_update()
        elif step == "shutdown":
            await llm.shutdown_weight_transfer_engine()
        elif step == "finish":
            await llm.finish_weight_update()
            # the weights came from a trainer: no digest, nothing on disk to restore from
            self.digest, self.weights_path = None, None
        else:
            raise ValueError(f"unknown weight-transfer step {step!r}")

    async def leave_group(self) -> None:
        await self._rpc("rlfleet_destroy_group", 30)
