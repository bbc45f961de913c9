"""SGLang's bodies, as SGLang 0.5 builds them: a /generate result (rlfleet.frontend.result)
as `GenerateResponse` with its `meta_info` (`managers/tokenizer_manager.py`, the finish
reasons of `managers/schedule_batch.py`), and the metadata routes' answers (model info,
server info with vLLM's `vllm_config`, load) from the workers' discovery entries. The
routes are rlfleet.frontend.sglang.routes."""

from __future__ import annotations

import time
from typing import Any

import msgspec

import rlfleet
from rlfleet.frontend.result import Result
from rlfleet.frontend.router import Worker
from rlfleet.protocol.engine import STALE_POLICY
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.sglang import UNVERSIONED_LABEL, GenerateResponse, MetaInfo, SglangGenerateRequest


def _finish(reason: str | None, stop_reason, token_ids: list[int], length: int,
            stale: bool = False) -> dict | None:
    """The finish reason as SGLang's FINISH_* classes render it (schedule_batch.py)."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "abort":
        return {"type": "abort", "message": STALE_POLICY if stale else "request aborted",
                "status_code": None, "err_type": None}
    # a stop string or stop token (vLLM's stop_reason), else the EOS token that ended it
    matched = stop_reason if stop_reason is not None else (token_ids[-1] if token_ids else None)
    return {"type": "stop", "matched": matched}


def _entry(lp: float | None, token_id: int, text: str, with_text: bool) -> list:
    return [lp, token_id, text if with_text else None]


def generate_response(req: SglangGenerateRequest, res: Result, index: int = 0
                      ) -> GenerateResponse:
    """The answer for prompt `index` of `req` from its result so far."""
    it = req.item(index)
    c = res.choices[0]
    meta = MetaInfo(id=res.request_id,
                    finish_reason=_finish(c.finish_reason, c.stop_reason, c.token_ids,
                                          len(c.token_ids), c.stale_policy),
                    prompt_tokens=len(res.prompt_token_ids), completion_tokens=len(c.token_ids),
                    cached_tokens=res.cached_tokens or 0, **res.policy.stamped())
    if c.finish_reason is not None:
        # SGLang's spans always name a version (its unversioned weights: "default"; 0.5.23's
        # decoder refuses a null one)
        meta.weight_versions = [s if s.version is not None else
                                msgspec.structs.replace(s, version=UNVERSIONED_LABEL)
                                for s in res.spans(c)]
        if c.stale_policy:
            meta.stale_policy = True
        # (a stream renders the last token before the run's end event may have come)
        meta.e2e_latency = round((res.finished or time.time()) - res.received, 6)
    if it.return_logprob:
        text = req.return_text_in_logprobs
        lps = c.logprobs or []
        meta.output_token_logprobs = [_entry(lp.logprob, lp.token_id, lp.decoded, text)
                                      for lp in lps]
        meta.output_token_logprobs_length = len(lps)
        meta.input_token_logprobs = []
        if it.top_logprobs_num > 0:
            meta.output_top_logprobs = [[_entry(v, t, d, text) for t, v, d in lp.top]
                                        for lp in lps]
            meta.input_top_logprobs = []
        if it.logprob_start_len >= 0 and res.prompt_logprobs is not None:
            _input_logprobs(meta, res, it.logprob_start_len, it.top_logprobs_num, text)
    return GenerateResponse(text=c.text, output_ids=list(c.token_ids), meta_info=meta)


def _input_logprobs(meta: MetaInfo, res: Result, start: int, top: int, text: bool) -> None:
    """input_token_logprobs (and input_top_logprobs) from `start` on: the first prompt
    position has no logprob (null), as in SGLang."""
    ids = res.prompt_token_ids
    strs = res.prompt_token_strs or []
    entries, tops = [], []
    for i, e in enumerate(res.prompt_logprobs or []):
        if i < start:
            continue
        own = None if e is None else e.get(str(ids[i]))
        decoded = own.decoded_token if own is not None else (strs[i] if i < len(strs) else "")
        entries.append(_entry(None if own is None else own.logprob, ids[i], decoded, text))
        if top > 0:
            if e is None:
                tops.append(None)
                continue
            ranked = sorted(((p.rank or 0, int(t), p) for t, p in e.items()
                             if p.rank is not None and p.rank <= top), key=lambda x: x[0])
            tops.append([_entry(p.logprob, t, p.decoded_token, text) for _, t, p in ranked])
    meta.input_token_logprobs = entries
    if top > 0:
        meta.input_top_logprobs = tops


def serving_policy(workers: list[Worker]) -> PolicyIdentity:
    """The policy the model's usable workers serve (the newest step among them)."""
    usable = [w for w in workers if w.usable] or workers
    return max(usable, key=lambda w: (w.step is not None, w.step or 0)).policy


def model_info_body(model: str, workers: list[Worker]) -> dict[str, Any]:
    """GET /model_info's answer for `model` served by `workers` (usable first)."""
    entry = workers[0].entry
    path = entry.get("model_path") or model
    return {
        "model_path": path,
        "tokenizer_path": entry.get("tokenizer") or path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": serving_policy(workers).version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,  # the frontend does not read the model's config.json
        "architectures": None,
        # rlfleet: the name requests use, and the rest of the policy identity
        "served_model_name": model,
        **serving_policy(workers).stamped(),
    }


def weight_version_body(workers: list[Worker]) -> dict[str, Any]:
    policy = serving_policy(workers)
    return {"weight_version": policy.version, **policy.stamped()}


def _vllm_config(model: str, entry: dict[str, Any], workers: list[Worker]) -> dict[str, Any]:
    """What vLLM's VllmConfig says that a client reads, from the discovery entry."""
    path = entry.get("model_path") or model
    backend = entry.get("weight_transfer_backend")
    return {
        "model_config": {"model": path, "tokenizer": entry.get("tokenizer") or path,
                         "served_model_name": model, "max_model_len": entry.get("max_model_len"),
                         "logprobs_mode": entry.get("logprobs_mode"),
                         "skip_tokenizer_init": False},
        "parallel_config": {"world_size": entry.get("world_size"),
                            "data_parallel_size": len(workers)},
        "weight_transfer_config": {"backend": backend} if backend not in (None, "none") else None,
    }


def server_info_body(model: str, workers: list[Worker], served: list[str], fmt: str
                     ) -> dict[str, Any]:
    """GET /server_info's answer: SGLang's fields and vLLM's, `vllm_config` as a JSON tree
    (`fmt` "json") or its text."""
    entry = workers[0].entry
    mml = entry.get("max_model_len")
    path = entry.get("model_path") or model
    vllm = _vllm_config(model, entry, workers)
    return {
        # SGLang: ServerArgs fields, scheduler info, internal states, version
        "model_path": path, "tokenizer_path": entry.get("tokenizer") or path,
        "served_model_name": model, "context_length": mml, "is_embedding": False,
        "skip_tokenizer_init": False, "tp_size": entry.get("world_size") or 1,
        "dp_size": len(workers), "weight_version": serving_policy(workers).version,
        "max_req_input_len": mml - 1 if isinstance(mml, int) and mml > 1 else None,
        "internal_states": [{"instance_id": w.instance_id, "usable": w.usable,
                             "inflight": w.inflight, **w.policy.stamped()} for w in workers],
        "version": rlfleet.__version__,
        # rlfleet: every model this frontend serves
        "served_models": served,
        # vLLM: GET /server_info
        "vllm_config": vllm if fmt == "json" else _as_text(vllm),
        "vllm_env": {}, "system_env": {},
    }


def _as_text(tree: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in tree.items())


def load_rows(workers: list[Worker]) -> list[dict[str, Any]]:
    """GET /get_load's rows: one per worker (SGLang: per data-parallel rank), the requests
    this frontend has in flight on it."""
    now = time.perf_counter()
    rows = []
    for rank, w in enumerate(sorted(workers, key=lambda w: w.instance_id)):
        rows.append({"dp_rank": rank, "num_reqs": w.inflight, "num_waiting_reqs": 0,
                     "ts_tic": now, "instance_id": w.instance_id, "model": w.model})
    return rows
