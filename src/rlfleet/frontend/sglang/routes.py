"""SGLang's native server routes on the frontend, as SGLang 0.5 answers it, plus the
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
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend import generation as gen
from rlfleet.frontend.result import Result
from rlfleet.frontend.router import RELIST_DEADLINE, Worker
from rlfleet.frontend.runs import GenerationRun
from rlfleet.frontend.sglang.render import (
    generate_response,
    load_rows,
    model_info_body,
    server_info_body,
    weight_version_body,
)
from rlfleet.protocol.engine import GenerateRequest, SamplingOptions
from rlfleet.protocol.sglang import SglangGenerateRequest
from rlfleet.runtime.http import HttpError, json_response

log = logging.getLogger("rlfleet.frontend.sglang")

# how long /health_generate waits for a worker's token (SGLang's HEALTH_CHECK_TIMEOUT)
HEALTH_TIMEOUT = 20.0


def _request_ids(request: Request, req: SglangGenerateRequest) -> list[str]:
    """Each prompt's request ID: one prompt keeps its `rid` (else X-Request-Id, else a new
    one); a batch takes its list of rids, else `<rid>_<i>` as SGLang expands one rid, else
    `<X-Request-Id>-<i>` as the frontend names a batch's parts (its cancel route finds
    them so), else new ones."""
    n = req.batch_size
    if req.is_single:
        return [req.rid if isinstance(req.rid, str) else gen.request_id(request, "gen")]
    if isinstance(req.rid, list):
        return list(req.rid)
    header = request.headers.get(gen.REQUEST_ID_HEADER)
    if header is not None:
        base = gen.request_id(request, "gen")
        return [gen.batch_request_id(base, i, n) for i in range(n)]
    if isinstance(req.rid, str):
        return [f"{req.rid}_{i}" for i in range(n)]
    return [uuid.uuid4().hex for _ in range(n)]


async def generate(request: Request) -> Response:
    req: SglangGenerateRequest = await gen.parse_body(request, SglangGenerateRequest)
    model = gen.served_model(request, req.adapter or req.model)
    rids = _request_ids(request, req)
    greqs = []
    for i, (rid, it) in enumerate(zip(rids, req.items(), strict=True)):
        greqs.append(gen.engine_request(lambda rid=rid, it=it, i=i: GenerateRequest(
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
        call = await gen.follow(request, model, greqs, results, req.policy,
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
                    yield gen.sse(out)
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


def _may_abort(fe: gen.Frontend, run: GenerationRun, token: str | None, admin: str | None
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
    fe = gen.frontend_of(request)
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
    fe = gen.frontend_of(request)
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
                call = await gen.follow(request, model, greq, res)
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
    pool = gen.frontend_of(request).pool
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
    fe = gen.frontend_of(request)
    model = gen.served_model(request, request.query_params.get("model"))
    workers = fe.pool.for_model(model)
    if not workers:
        raise HttpError(404, f"model {model!r} is not served by any worker", param="model")
    return model, sorted(workers, key=lambda w: (not w.usable, w.instance_id))


async def model_info(request: Request) -> Response:
    model, workers = await _model_now(request)
    return json_response(model_info_body(model, workers))


async def get_weight_version(request: Request) -> Response:
    """SGLang 0.5's GET /get_weight_version: the weight version the model's workers serve
    (rlfleet: with the rest of the policy identity)."""
    _, workers = await _model_now(request)
    return json_response(weight_version_body(workers))


async def server_info(request: Request) -> Response:
    """SGLang's server info and vLLM's, in one answer: a client of either finds its fields.
    `?config_format=json` (vLLM's parameter) makes `vllm_config` a JSON tree; without it
    (or `text`) it is that tree's text, as vLLM answers by default."""
    fmt = request.query_params.get("config_format", "text")
    if fmt not in ("text", "json"):
        raise HttpError(400, f"config_format must be 'text' or 'json', got {fmt!r}",
                        param="config_format")
    fe = gen.frontend_of(request)
    model, workers = await _model_now(request)
    return json_response(server_info_body(model, workers, fe.pool.models(), fmt))


async def get_load(request: Request) -> Response:
    """One row per worker (SGLang: per data-parallel rank): the requests this frontend has
    in flight on it. The frontend queues nothing for a worker (num_waiting_reqs 0); an
    engine's own token counts are not in discovery and are left out."""
    fe = gen.frontend_of(request)
    return json_response(load_rows(list(fe.pool.workers.values())))


#: /generate takes a POST (or PUT, as SGLang), the metadata routes a GET; two names each
#: for the model and server info, as SGLang serves them
router = Router(routes=[
    Route("/generate", generate, methods=["POST", "PUT"]),
    *(Route(path, handler, methods=["GET"]) for path, handler in (
        ("/health_generate", health_generate),
        ("/model_info", model_info), ("/get_model_info", model_info),
        ("/server_info", server_info), ("/get_server_info", server_info),
        ("/get_load", get_load),
        ("/get_weight_version", get_weight_version),
    )),
])
