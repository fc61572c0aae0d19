"""The Ray Serve deployment: one engine per replica behind an OpenAI-compatible FastAPI app.

Each replica loads the target once (on the GPU Ray gives it, else the CPU) and routes with its own
router, merged with the others' through the shared ledger (`stats`). Every request joins the
engine's running batch at its next step and leaves it when done; its deadline, or its client
leaving, ends its row at the next step. What keeps an exposed server safe lives in modules of its
own (`guards`, `limits`, `planning`, `turns`, `admission`, `errors`, `health`). `build_app(args)` is
the application builder for Serve config files (docs/serve.md); the CLI calls it too. No postponed
annotations here: FastAPI reads the handlers' (`Request`) at run time, through Serve's ingress wrapper.
"""
import asyncio
import contextlib
import json
import logging
import os
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from ray import serve

from flashspec_core.constrained.grammar import compile_workers, set_cache_limit
from flashspec_core.memory_plan import MEMORY_FRACTION
from flashspec_core.models import vocab_size
from flashspec_core.options import RequestOptions
from flashspec_core.results import GenerationResult
from flashspec_integrations.plan import CallPlan
from flashspec_integrations.serve import errors, protocol
from flashspec_integrations.serve.admission import Admission, Ticket
from flashspec_integrations.serve.guards import API_KEY_ENV, APIKeyMiddleware, BodyLimits, resolve_api_key
from flashspec_integrations.serve.health import EngineActivity, EngineUnhealthy, HealthProbe
from flashspec_integrations.serve.limits import Limits, check_request
from flashspec_integrations.serve.planning import Planner
from flashspec_integrations.serve.protocol import APIError
from flashspec_integrations.serve.stats import share_router
from flashspec_integrations.serve.translate import DeltaStream, call_info, plan_call, reply_message
from flashspec_integrations.serve.turns import CompileTurns

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEPLOYMENT_NAME = "FlashSpecServer"
# Ray Serve sends a replica up to max_in_flight + this many requests at once. The headroom is for
# requests that hold no slot: those still sending their body (each for at most body_timeout_s: a
# few hundred stalled bodies leave a replica answering), and overload, which so reaches the
# replica's own count and gets its 429 at once. While every place is taken, Ray's proxy queues
# QUEUED_PER_SLOT times max_in_flight more, plus as many again as the headroom (a 503 past them).
ONGOING_HEADROOM = 256
QUEUED_PER_SLOT = 4
WORKER_STARTUP_S = 60.0  # how long a replica waits at start for its grammar compile processes
logger = logging.getLogger("flashspec.serve")


class ServeSettings(BaseModel):
    """What every replica is built with (the `args` of a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(None, description="target model: a folder, .gguf file or cached HF id; "
                                                  "None: the embedded default")
    model_name: str | None = Field(None, description="the id clients send as `model`; default: the target's name")
    device: str | None = Field(None, description="None: the replica's GPU if Ray gave it one, else the CPU")
    router_store: str | None = Field(None, description="the shared router ledger (SQLite); None: the default store")
    sync_seconds: float = Field(2.0, ge=0, description="how often a replica merges the others' router statistics")
    max_batch_size: int = Field(8, ge=1, description="rows the engine decodes together; more wait for a slot")
    memory_fraction: float = Field(MEMORY_FRACTION, gt=0, le=1,
                                   description="share of the memory free at a replica's start its rows' caches may use "
                                               "(fewer rows where max_batch_size would not fit)")
    max_context: int | None = Field(None, ge=2, description="tokens (prompt + new) one request may hold, below the "
                                                           "model's context window; None: the window")
    default_max_tokens: int = Field(512, gt=0, description="new tokens when a request sets no max_tokens")
    threads: int | None = Field(None, gt=0, description="torch CPU threads per replica; None: Ray's CPU share")
    api_key: SecretStr | None = Field(None, description=f"clients send it as a Bearer token; None: ${API_KEY_ENV} "
                                                        "of each replica, else no key")
    max_in_flight: int = Field(64, ge=1, description="requests in flight per replica; past it a 429 with Retry-After")
    request_timeout_s: float = Field(300.0, gt=0, description="seconds from a request's arrival to its reply's end")
    limits: Limits = Field(default_factory=Limits,  # type: ignore[arg-type]  # pydantic without its mypy plugin
                           description="what one request may ask (serve/limits.py)")

    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return DEFAULT_MODEL_NAME if self.target is None else Path(self.target).name or self.target


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


app = FastAPI(title="FlashSpec OpenAI-compatible API")
app.add_middleware(BodyLimits)
app.add_middleware(APIKeyMiddleware)  # added last, so it runs first: no body is read for a stranger
errors.install(app)


@serve.deployment(name=DEPLOYMENT_NAME, max_ongoing_requests=32, health_check_period_s=5)
@serve.ingress(app)
class FlashSpecServer:
    def __init__(self, settings: dict | ServeSettings):
        from flashspec_core.engine import SpecEngine

        self.settings = ServeSettings.model_validate(settings)
        cpus = int(os.environ.get("OMP_NUM_THREADS") or 0)
        if self.settings.threads or cpus:
            torch.set_num_threads(self.settings.threads or cpus)
        self.engine = SpecEngine.from_pretrained(self.settings.target, device=self.settings.device,
                                                 max_batch=self.settings.max_batch_size,
                                                 memory_fraction=self.settings.memory_fraction,
                                                 max_context=self.settings.max_context)
        self.shared = share_router(self.engine, self.settings.router_store, self.settings.sync_seconds)
        self.model_name = self.settings.served_name()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._guard(self.settings)

    def _guard(self, settings: ServeSettings) -> None:
        """The key, the limits, admission, planning threads and the health probe of this replica."""
        limits = settings.limits
        app.state.api_key = resolve_api_key(settings.api_key.get_secret_value() if settings.api_key else None)
        app.state.max_body_bytes, app.state.body_timeout_s = limits.max_body_bytes, limits.body_timeout_s
        if app.state.api_key is None:
            logger.warning("no API key (api_key, $%s): every client that reaches Ray Serve's HTTP proxy "
                           "can use this server", API_KEY_ENV)
        set_cache_limit(limits.grammar_cache_mb << 20)
        if not compile_workers(self.engine.tokenizer, vocab_size(self.engine.target_model),
                               self.engine.eos_ids).wait_ready(WORKER_STARTUP_S):
            logger.warning("no grammar worker process started within %g s; requests with a schema wait for one",
                           WORKER_STARTUP_S)
        self.admission = Admission(settings.max_in_flight, settings.request_timeout_s, lambda: self.engine.queued)
        self.planner = Planner(limits.planning_timeout_s, retry_after=self.admission.retry_after)
        self.turns = CompileTurns(limits.max_compiles_per_client, limits.planning_timeout_s)
        self.activity = EngineActivity()
        probe_ids = self.engine.tokenizer("Hi", add_special_tokens=False).input_ids or [0]
        self.health = HealthProbe(lambda: self.engine.generate(probe_ids, max_new_tokens=1, domain="chat"),
                                  busy=lambda: self.admission.in_flight > 0 or self.activity.busy)

    def _info(self, plan: CallPlan, stats: Any) -> dict:
        return {**call_info(plan, stats, self.engine.running), "replica": self.replica, "pid": os.getpid(),
                **self.shared.info()}

    def _options(self, plan: CallPlan, timeout: float) -> RequestOptions:
        """The engine options of a planned request that has `timeout` seconds left."""
        return plan.options(max(timeout, 1e-3))  # the schema compiled when planned

    def _plan(self, req: protocol.ChatCompletionRequest, retry_after: int) -> CallPlan:
        if req.model != self.model_name:
            raise APIError(404, f"model: {req.model[:200]!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", code="model_not_found")
        limits = self.settings.limits
        check_request(req, limits, self.engine.context_window)
        return plan_call(self.engine, req, min(self.settings.default_max_tokens, limits.max_tokens),
                         limits.prompt_tokens(self.engine.context_window), limits.compile_timeout_s, retry_after)

    def _turn(self, request: Request, req: protocol.ChatCompletionRequest,
              retry_after: int) -> contextlib.AbstractAsyncContextManager[None]:
        """The client's turn at the grammar compilers (`turns`) for a request with a schema to compile."""
        fmt = req.response_format
        if not req.tools and (fmt is None or fmt.type == "text"):
            return contextlib.nullcontext()
        return self.turns.turn(request.client.host if request.client else "", retry_after)

    async def check_health(self) -> None:
        """Ray Serve's health check (every `health_check_period_s`): see `health`."""
        await self.health.check()

    @app.get("/health")
    async def health_route(self) -> Response:
        """The same check for load balancers; needs no key."""
        try:
            status = await self.health.check()
        except EngineUnhealthy as exc:
            return errors.respond(APIError(503, str(exc), kind="server_error", code="unhealthy"))
        return JSONResponse({"status": status, "model": self.model_name, "replica": self.replica,
                             **self.admission.info()})

    @app.get("/v1/models")
    async def models(self) -> dict:
        return protocol.model_list(self.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        rid = errors.request_id(request)
        body = await request.body()  # whole already, within its time (`guards.BodyLimits`): no slot is held for it
        try:
            ticket = self.admission.admit()
        except APIError as exc:
            return errors.respond(exc)
        streaming = False
        try:
            req = protocol.parse_request(body)
            retry_after = self.admission.retry_after()  # read here: planning runs on another thread
            async with self._turn(request, req, retry_after):
                plan = await self.planner.run(lambda: self._plan(req, retry_after))
            cid = protocol.completion_id()
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                events = self._events(plan, cid, include_usage, ticket, rid)
                weakref.finalize(events, ticket.release)  # a stream never started still frees its slot
                streaming = True
                return StreamingResponse(events, media_type="text/event-stream")
            try:
                with self.activity:  # the engine ends the row at its deadline, at the next step
                    await asyncio.to_thread(self.shared.sync)
                    res = await self.engine.agenerate(plan.prompt_ids, self._options(plan, ticket.remaining()))
                    assert isinstance(res, GenerationResult)  # one prompt: one result
            except TimeoutError:
                return errors.respond(self.admission.deadline_error())
            except Exception as exc:  # an OpenAI-style error for this request only
                return errors.respond(errors.engine_error(exc, rid, self.admission.retry_after()))
        except APIError as exc:
            return errors.respond(exc)
        finally:
            if not streaming:
                ticket.release()
        message, finish, invalid = reply_message(plan, res.text, res.finish_reason)
        info = self._info(plan, res.stats)
        if invalid:
            info["invalid_tool_calls"] = invalid
        reply = protocol.completion(cid, self.model_name, message, finish,
                                    protocol.usage(len(plan.prompt_ids), len(res.token_ids)), info)
        return JSONResponse(reply)

    async def _pieces(self, plan: CallPlan, timeout: float) -> AsyncGenerator[Any, None]:
        """The engine's chunks of a stream (no thread held between them)."""
        with self.activity:
            await asyncio.to_thread(self.shared.sync)
            async for piece in self.engine.astream(plan.prompt_ids, self._options(plan, timeout)):
                yield piece

    async def _events(self, plan: CallPlan, cid: str, include_usage: bool, ticket: Ticket,
                      rid: str) -> AsyncIterator[str]:
        """Server-sent events: the role, content or tool-call deltas, the finish (with the
        `flashspec` field), usage if asked, then [DONE]. A failure mid-stream, or the deadline
        passing, is sent as an `error` event (the status line has gone out already), never a
        silent end. The stream's end, or the client leaving, stops its decode and frees its slot."""
        deltas = DeltaStream(plan)
        pieces = self._pieces(plan, ticket.remaining())
        try:
            yield _sse(protocol.chunk(cid, self.model_name, {"role": "assistant", "content": ""}))
            tokens = 0
            while True:
                try:  # past the deadline the wait is cancelled, which closes the engine's stream
                    piece = await asyncio.wait_for(anext(pieces), ticket.remaining())
                except StopAsyncIteration:
                    break
                tokens += len(piece.token_ids)
                for delta in deltas.feed(piece.text, piece.finish_reason):
                    yield _sse(protocol.chunk(cid, self.model_name, delta))
                if piece.finish_reason is not None:
                    finish = deltas.finish_reason(piece.finish_reason)
                    info = self._info(plan, piece.stats)
                    yield _sse(protocol.chunk(cid, self.model_name, {}, finish, flashspec=info))
            if include_usage:
                yield _sse(protocol.chunk(cid, self.model_name, None,
                                          usage=protocol.usage(len(plan.prompt_ids), tokens)))
        except TimeoutError:
            yield _sse(self.admission.deadline_error().body())
        except Exception as exc:  # reported to the client, which must not wait on it
            yield _sse(errors.engine_error(exc, rid, self.admission.retry_after()).body())
        finally:
            await pieces.aclose()
            ticket.release()
        yield "data: [DONE]\n\n"


def _deployment(settings: ServeSettings) -> serve.Deployment:
    """The replica class as `@serve.deployment` made it (a Deployment, whatever its class says),
    with Ray Serve's own bounds set from the replica's in-flight limit (`admission`)."""
    return cast(serve.Deployment, FlashSpecServer).options(
        max_ongoing_requests=settings.max_in_flight + ONGOING_HEADROOM,
        max_queued_requests=QUEUED_PER_SLOT * settings.max_in_flight + ONGOING_HEADROOM)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from Serve config `args` (ServeSettings fields); replicas, autoscaling
    and resources come from the config file's `deployments:` section."""
    settings = ServeSettings.model_validate(args or {})
    return _deployment(settings).bind(settings.model_dump())


def application(settings: ServeSettings, replicas: int | dict, num_cpus: float, num_gpus: float) -> serve.Application:
    """The application with `replicas` fixed replicas (or an autoscaling config dict), each
    holding `num_cpus` CPUs and `num_gpus` GPUs (the CLI's path)."""
    scaling = {"autoscaling_config": replicas} if isinstance(replicas, dict) else {"num_replicas": replicas}
    deployment = _deployment(settings).options(
        **scaling, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    return deployment.bind(settings.model_dump())
