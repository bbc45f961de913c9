"""SGLang's native server surface on the frontend, as SGLang 0.5 answers it, plus the
server-info route vLLM shares with it.

Each route follows the schema of (sgl-project/sglang, python/sglang/srt/ unless named):
- POST /generate: `entrypoints/http_server.py` `generate_request`; the request is
  `managers/io_struct.py` `GenerateReqInput` (rlfleet.protocol.sglang), the answer and its
  `meta_info` are built as `managers/tokenizer_manager.py` builds them (a batch: a JSON
  list; streamed: cumulative events, a batch's events each with its prompt's `index`).
- GET /health_generate: `http_server.py` `health_generate` (a one-token generation through
  a worker of each served model: 200, else 503).
- GET /model_info, /get_model_info: `http_server.py` `model_info`; GET
  /get_weight_version: `http_server.py` `get_weight_version` (SGLang 0.5).
- GET /server_info, /get_server_info: `http_server.py` `server_info` (server args,
  scheduler info, `internal_states`, `version`) and, in the same answer, vLLM 0.32's
  `vllm/entrypoints/serve/dev/server_info/api_router.py` (`vllm_config`: text by default,
  a JSON tree with `?config_format=json`, which TRL reads `model_config.logprobs_mode`
  from; `vllm_env`, `system_env`).
- GET /get_load: `http_server.py` `get_load` (one row per worker, in place of SGLang's
  data-parallel ranks).
- POST /abort_request: `http_server.py` `abort_request` (`io_struct.py` `AbortReq`: `rid`,
  or `abort_all`), served by rlfleet.frontend.app beside the cancel route whose relay to
  other frontend processes it shares; `abort_runs` here aborts this process's runs.
Values come from the workers' discovery entries (rlfleet.protocol.rl.WorkerEntry).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

import rlfleet
from rlfleet.frontend.generation import (
    REQUEST_ID_HEADER,
    Frontend,
    batch_request_id,
    engine_request,
    follow,
    frontend_of,
    parse_body,
    request_id,
    served_model,
    sse,
)
from rlfleet.frontend.result import Result
from rlfleet.frontend.router import RELIST_DEADLINE, Worker
from rlfleet.frontend.runs import GenerationRun
from rlfleet.protocol.engine import STALE_POLICY, GenerateRequest, SamplingOptions
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.sglang import (
    UNVERSIONED_LABEL,
    GenerateResponse,
    MetaInfo,
    SglangGenerateRequest,
)
from rlfleet.runtime.http import HttpError, json_response

log = logging.getLogger("rlfleet.frontend.sglang")

# how long /health_generate waits for a worker's token (SGLang's HEALTH_CHECK_TIMEOUT)
HEALTH_TIMEOUT = 20.0


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


def _request_ids(request: Request, req: SglangGenerateRequest) -> list[str]:
    """Each prompt's request ID: one prompt keeps its `rid` (else X-Request-Id, else a new
    one); a batch takes its list of rids, else `<rid>_<i>` as SGLang expands one rid, else
    `<X-Request-Id>-<i>` as the frontend names a batch's parts (its cancel route finds
    them so), else new ones."""
    n = req.batch_size
    if req.is_single:
        return [req.rid if isinstance(req.rid, str) else request_id(request, "gen")]
    if isinstance(req.rid, list):
        return list(req.rid)
    header = request.headers.get(REQUEST_ID_HEADER)
    if header is not None:
        base = request_id(request, "gen")
        return [batch_request_id(base, i, n) for i in range(n)]
    if isinstance(req.rid, str):
        return [f"{req.rid}_{i}" for i in range(n)]
    return [uuid.uuid4().hex for _ in range(n)]


async def generate(request: Request) -> Response:
    req: SglangGenerateRequest = await parse_body(request, SglangGenerateRequest)
    model = served_model(request, req.adapter or req.model)
    rids = _request_ids(request, req)
    greqs = []
    for i, (rid, it) in enumerate(zip(rids, req.items(), strict=True)):
        greqs.append(engine_request(lambda rid=rid, it=it, i=i: GenerateRequest(
            request_id=rid, prompt_token_ids=it.input_ids, prompt=it.text,
            sampling=req.sampling(i), stream=req.stream, cache_salt=it.cache_salt,
            session_id=req.session_id,
            # the prompt tokens' text, for input logprob entries that have no logprob
            echo=req.return_text_in_logprobs and it.return_logprob
            and it.logprob_start_len >= 0)))
    results = [Result(rid, 1) for rid in rids]
    runs: list[GenerationRun] = []  # abortable by rid from the start (a unary run's
    # worker sends nothing before its end)
    try:
        call = await follow(request, model, greqs, results, req.policy,
                            on_start=lambda started: runs.extend(_track(request, started)))
    except BaseException:
        _untrack(request, runs)
        raise
    single = req.is_single

    def render() -> Any:
        if single:
            return generate_response(req, results[0])
        return [generate_response(req, r, i) for i, r in enumerate(results)]

    if not req.stream:
        try:
            return await call.unary(render)
        finally:
            _untrack(request, runs)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for p, deltas, done in call.batches():
                res = results[p]
                # the last event adds the input logprobs
                if deltas or (done and res.prompt_logprobs is not None):
                    out = generate_response(req, res, p)
                    if not single:
                        out.index = p
                    yield sse(out)
        finally:
            _untrack(request, runs)
    return call.stream(chunks())


# ------------------------------------------------------------------ abort by rid

# how many tracked runs the table holds before it forgets those that ended (a stream its
# caller left before it began is never untracked: it is found ended and forgotten then)
_PRUNE_AT = 1024


def _table(request: Request) -> dict[str, GenerationRun]:
    """This process's /generate runs in flight, by rid (kept or not: SGLang aborts any)."""
    state = request.app.state
    table = getattr(state, "sglang_runs", None)
    if table is None:
        table = state.sglang_runs = {}
    return table


def _track(request: Request, runs: list[GenerationRun]) -> list[GenerationRun]:
    table = _table(request)
    if len(table) >= _PRUNE_AT:
        for rid in [rid for rid, run in table.items() if run.done]:
            del table[rid]
    for run in runs:
        table[run.request_id] = run
    return runs


def _untrack(request: Request, runs: list[GenerationRun]) -> None:
    table = _table(request)
    for run in runs:
        if table.get(run.request_id) is run:
            del table[run.request_id]


def _may_abort(fe: Frontend, run: GenerationRun, token: str | None, admin: str | None
               ) -> bool:
    """A request nobody owns (no X-Request-Id, no X-Cancel-Token: SGLang's kind) may be
    aborted by anyone, as SGLang lets; one with an owner, as POST
    /v1/requests/{rid}/cancel decides (its cancel token, or the frontend's admin)."""
    if run.keep or run.cancel_token is not None:
        return fe.runs.may_cancel(run, token, admin)
    return True


async def abort_runs(request: Request, rid: str | None, token: str | None,
                     admin: str | None) -> tuple[int, int]:
    """Abort this process's request `rid` (None: every request the caller may abort) on
    its worker, which ends it with finish reason abort and its partial output. Returns
    (requests found, requests aborted); HttpError 403 when `rid` is another's."""
    fe = frontend_of(request)
    found = {k: r for k, r in _table(request).items() if not r.done}
    for k, r in fe.runs.runs.items():
        if not r.done:
            found.setdefault(k, r)
    if rid is not None:
        found = {rid: found[rid]} if rid in found else {}
    allowed = [r for r in found.values() if _may_abort(fe, r, token, admin)]
    if rid is not None and found and not allowed:
        raise HttpError(403, f"only the owner of request {rid!r} can abort it: send the "
                             "X-Cancel-Token header it was started with (or the frontend's "
                             "admin token as Authorization: Bearer)")
    aborted = 0
    for run in allowed:
        if run.worker is not None and await fe.client.cancel(run.worker.address,
                                                             run.request_id):
            aborted += 1
    return len(found), aborted


# ------------------------------------------------------------------ health and metadata


async def health_generate(request: Request) -> Response:
    """One token (greedy, from token ID 0) through a worker of each served model: 200 with
    an empty body when every model answered (as SGLang), else 503 saying why."""
    fe = frontend_of(request)
    models = fe.pool.models()
    if not models:
        return HttpError(503, "no worker serves a model yet").response()
    for model in models:
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        greq = GenerateRequest(request_id=rid, prompt_token_ids=[0], stream=False,
                               sampling=SamplingOptions(max_tokens=1, temperature=0.0))
        res = Result(rid, 1)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT):
                call = await follow(request, model, greq, res)
                try:
                    await call.to_end()
                finally:
                    call.end()
        except TimeoutError:
            return HttpError(503, f"model {model!r}: no token within {HEALTH_TIMEOUT:g} s"
                             ).response()
        except HttpError as e:
            return HttpError(503, f"model {model!r}: {e.message}").response()
        except Exception as e:  # noqa: BLE001 - a worker's failure is the answer here
            return HttpError(503, f"model {model!r}: {e}").response()
        if res.choices[0].count < 1 and res.choices[0].finish_reason != "stop":
            return HttpError(503, f"model {model!r}: the worker produced no token").response()
    return Response(status_code=200)


async def _model_now(request: Request) -> tuple[str, list[Worker]]:
    """`_model`, from discovery as it is now rather than as the pool's watch last saw it:
    what a worker reports (its policy) is in its entry before its control call returns, so
    a client that just moved the fleet (update_weights_from_disk through this URL, or the
    service directly) reads the version it set, whichever frontend process answers. A
    store that does not answer within RELIST_DEADLINE leaves the watch's view to answer."""
    pool = frontend_of(request).pool
    try:
        async with asyncio.timeout(RELIST_DEADLINE):
            entries = await pool.discovery.list(pool.namespace)
            generate = [e for e in entries if e.get("endpoint") == "generate"]
            # the committed records first, as the watch applies them (a worker's usability)
            await pool.read_committed({e.get("model") for e in generate})
    except Exception as e:  # noqa: BLE001 - the watch's view still answers
        log.warning("reading discovery for a weight version failed; answering from the "
                    "last view: %r", e)
    else:
        pool.update(generate)  # no await between this and the answer: it is what was read
    return _model(request)


def _model(request: Request) -> tuple[str, list[Worker]]:
    """The model a metadata request is about (`?model=`, else the one served) and its
    workers, usable first."""
    fe = frontend_of(request)
    model = served_model(request, request.query_params.get("model"))
    workers = fe.pool.for_model(model)
    if not workers:
        raise HttpError(404, f"model {model!r} is not served by any worker", param="model")
    return model, sorted(workers, key=lambda w: (not w.usable, w.instance_id))


def _policy(workers: list[Worker]) -> PolicyIdentity:
    """The policy the model's usable workers serve (the newest step among them)."""
    usable = [w for w in workers if w.usable] or workers
    return max(usable, key=lambda w: (w.step is not None, w.step or 0)).policy


async def model_info(request: Request) -> Response:
    model, workers = await _model_now(request)
    entry = workers[0].entry
    path = entry.get("model_path") or model
    return json_response({
        "model_path": path,
        "tokenizer_path": entry.get("tokenizer") or path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": _policy(workers).version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,  # the frontend does not read the model's config.json
        "architectures": None,
        # rlfleet: the name requests use, and the rest of the policy identity
        "served_model_name": model,
        **_policy(workers).stamped(),
    })


async def get_weight_version(request: Request) -> Response:
    """SGLang 0.5's GET /get_weight_version: the weight version the model's workers serve
    (rlfleet: with the rest of the policy identity)."""
    _, workers = await _model_now(request)
    policy = _policy(workers)
    return json_response({"weight_version": policy.version, **policy.stamped()})


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


async def server_info(request: Request) -> Response:
    """SGLang's server info and vLLM's, in one answer: a client of either finds its fields.
    `?config_format=json` (vLLM's parameter) makes `vllm_config` a JSON tree; without it
    (or `text`) it is that tree's text, as vLLM answers by default."""
    fmt = request.query_params.get("config_format", "text")
    if fmt not in ("text", "json"):
        raise HttpError(400, f"config_format must be 'text' or 'json', got {fmt!r}",
                        param="config_format")
    fe = frontend_of(request)
    model, workers = await _model_now(request)
    entry = workers[0].entry
    mml = entry.get("max_model_len")
    path = entry.get("model_path") or model
    vllm = _vllm_config(model, entry, workers)
    return json_response({
        # SGLang: ServerArgs fields, scheduler info, internal states, version
        "model_path": path, "tokenizer_path": entry.get("tokenizer") or path,
        "served_model_name": model, "context_length": mml, "is_embedding": False,
        "skip_tokenizer_init": False, "tp_size": entry.get("world_size") or 1,
        "dp_size": len(workers), "weight_version": _policy(workers).version,
        "max_req_input_len": mml - 1 if isinstance(mml, int) and mml > 1 else None,
        "internal_states": [{"instance_id": w.instance_id, "usable": w.usable,
                             "inflight": w.inflight, **w.policy.stamped()} for w in workers],
        "version": rlfleet.__version__,
        # rlfleet: every model this frontend serves
        "served_models": fe.pool.models(),
        # vLLM: GET /server_info
        "vllm_config": vllm if fmt == "json" else _as_text(vllm),
        "vllm_env": {}, "system_env": {},
    })


def _as_text(tree: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in tree.items())


async def get_load(request: Request) -> Response:
    """One row per worker (SGLang: per data-parallel rank): the requests this frontend has
    in flight on it. The frontend queues nothing for a worker (num_waiting_reqs 0); an
    engine's own token counts are not in discovery and are left out."""
    fe = frontend_of(request)
    now = time.perf_counter()
    rows = []
    for rank, w in enumerate(sorted(fe.pool.workers.values(), key=lambda w: w.instance_id)):
        rows.append({"dp_rank": rank, "num_reqs": w.inflight, "num_waiting_reqs": 0,
                     "ts_tic": now, "instance_id": w.instance_id, "model": w.model})
    return json_response(rows)


router = Router(routes=[
    Route("/generate", generate, methods=["POST", "PUT"]),
    Route("/health_generate", health_generate, methods=["GET"]),
    Route("/model_info", model_info, methods=["GET"]),
    Route("/get_model_info", model_info, methods=["GET"]),
    Route("/server_info", server_info, methods=["GET"]),
    Route("/get_server_info", server_info, methods=["GET"]),
    Route("/get_load", get_load, methods=["GET"]),
    Route("/get_weight_version", get_weight_version, methods=["GET"]),
])
