"""The vLLM engine (AsyncLLM) behind the worker contract."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from rlfleet.protocol.engine import MAX_LOGPROBS, GenerateRequest, SamplingOptions
from rlfleet.runtime import metrics
from rlfleet.runtime.engine import BadRequest, Engine, EngineInfo
from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature

log = logging.getLogger("rlfleet.vllm")

try:  # vLLM's validation errors are not all ValueErrors
    from vllm.exceptions import VLLMClientError

    _CLIENT_ERRORS: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
except ImportError:  # older vLLM
    _CLIENT_ERRORS = (ValueError,)


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
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


def _token_logprobs(token_ids, logprobs, k: int) -> list[dict]:
    """vLLM's per-position {token_id: Logprob} dicts → TokenLogprob dicts, 1:1 with token_ids."""
    out = []
    for tid, pos in zip(token_ids, logprobs, strict=True):
        chosen = pos[tid]
        top = []
        if k > 0:
            ranked = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = [(t, lp.logprob, lp.decoded_token or "") for t, lp in ranked[:k]]
        out.append({"token_id": tid, "logprob": chosen.logprob, "rank": chosen.rank,
                    "decoded": chosen.decoded_token or "", "top": top})
    return out


def _prompt_logprobs(prompt_ids: list[int], prompt_logprobs) -> list[dict | None]:
    """The contract's shape: position 0 null, then {"<id>": {logprob, rank, decoded_token}}."""
    out: list[dict | None] = []
    for i, pos in enumerate(prompt_logprobs):
        if pos is None or i == 0:
            out.append(None)
            continue
        entries = {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                            "decoded_token": lp.decoded_token or ""}
                   for t, lp in pos.items()}
        if str(prompt_ids[i]) not in entries:  # never expected; keep alignment honest
            raise RuntimeError(f"engine returned no logprob for prompt token at position {i}")
        out.append(entries)
    return out


def _span(w) -> dict:
    """vLLM's WeightVersionSpan (labelled "<version>|<digest>" by set_version) → the
    response shape {"version", "digest", "start", "end"}."""
    version, _, digest = w.version.rpartition("|")
    return {"version": version or None, "digest": digest or None, "start": w.start, "end": w.end}


class VllmEngine(Engine):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm = None
        self.tokenizer = None
        self._running = 0
        path = Path(args.model)
        name = args.served_model_name or path.name
        self.version: str | None = None  # caller-declared weight version
        self.version_declared = False
        self.digest: str | None = None  # content digest of the weights applied
        self.weights_path: str | None = None  # where the live weights were read from
        self.signature: dict = {}  # tensor name -> (dtype, shape) the model accepts
        self.on_gpu = False
        self.info = EngineInfo(served_model_name=name, model_path=str(path.resolve()) if path.exists()
                               else args.model, vocab_size=0, max_model_len=0)

    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        a = self.args
        return AsyncEngineArgs(
            model=a.model, served_model_name=self.info.served_model_name, dtype=a.dtype,
            max_model_len=a.max_model_len, enforce_eager=a.enforce_eager, seed=a.seed,
            logprobs_mode=a.logprobs_mode, max_logprobs=MAX_LOGPROBS,
            enable_prefix_caching=True, max_num_seqs=a.max_num_seqs,
            disable_log_stats=True, worker_extension_cls=a.worker_extension_cls,
        )

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(self.engine_args())
        mc = self.llm.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.info.vocab_size = mc.get_vocab_size()
        self.info.max_model_len = mc.max_model_len
        self.info.eos_token_ids = (eos,) if eos is not None else ()
        self.on_gpu = self.llm.vllm_config.device_config.device_type == "cuda"
        if Path(self.args.model).is_dir():
            self.weights_path = str(Path(self.args.model).resolve())
            self.signature = checkpoint_signature(Path(self.weights_path))
            self.digest = checkpoint_digest(Path(self.weights_path))
        await self.set_version(None, declared=False)
        if self.args.warmup:
            await self._warmup()

    async def set_version(self, version: str | None, declared: bool,
                          digest: str | None = None) -> None:
        """Record the weight identity; the engine stamps the version on tokens it samples."""
        self.version, self.version_declared = version, declared
        if digest is not None:
            self.digest = digest
        await self.llm.update_weight_version(f"{version or ''}|{self.digest or ''}")

    def weight_identity(self) -> dict:
        return {"weight_version": self.version, "weight_digest": self.digest}

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
                 chat_template_kwargs=None) -> list[int]:
        if messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    **(chat_template_kwargs or {}))
            except Exception as e:
                raise BadRequest(f"cannot render these messages with the chat template: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]

    def num_running(self) -> int:
        return self._running

    async def generate(self, req: GenerateRequest, prompt_token_ids: list[int]) -> AsyncIterator[dict]:
        from vllm.inputs import TokensPrompt

        s = req.sampling
        room = self.info.max_model_len - len(prompt_token_ids)
        try:
            sp = _sampling_params(s, room, req.stream)
        except _CLIENT_ERRORS as e:  # vLLM's own checks of the sampling parameters
            raise BadRequest(str(e)) from e
        k = s.logprobs or 0
        results = self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), sp,
                                    req.request_id)
        prompt_lps = None
        started = False
        self._running += 1
        metrics.WORKER_RUNNING.inc()
        metrics.WORKER_PROMPT_TOKENS.inc(len(prompt_token_ids))
        try:
            async for out in results:
                started = True
                if prompt_lps is None and out.prompt_logprobs is not None:
                    prompt_lps = _prompt_logprobs(prompt_token_ids, out.prompt_logprobs)
                choices = []
                for c in out.outputs:
                    ids = list(c.token_ids)
                    if not ids and c.finish_reason is None:
                        continue
                    metrics.WORKER_GENERATED_TOKENS.inc(len(ids))
                    choice = {
                        "index": c.index, "token_ids": ids, "text": c.text,
                        "logprobs": _token_logprobs(ids, c.logprobs, k)
                        if s.logprobs is not None and c.logprobs is not None else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    }
                    if c.weight_versions:
                        choice["weight_versions"] = [_span(w) for w in c.weight_versions]
                    choices.append(choice)
                if choices:
                    yield {"choices": choices}
            yield {"done": True, "prompt_logprobs": prompt_lps}
        except _CLIENT_ERRORS as e:
            if not started:  # vLLM's input checks
                raise BadRequest(str(e)) from e
            raise
        finally:
            self._running -= 1
            metrics.WORKER_RUNNING.dec()
            await results.aclose()

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF-format checkpoint directory (or hub name)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true",
                   default=os.environ.get("RLFLEET_ENFORCE_EAGER", "") not in ("", "0"),
                   help="skip graph compilation (faster start, slower decode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs-mode", default="processed_logprobs",
                   choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
                   help="processed_logprobs: log-softmax after temperature/top-k/top-p, what an RL "
                        "trainer's importance ratio needs")
    p.add_argument("--worker-extension-cls", default="rlfleet.vllm.extension.WorkerExtension")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")

