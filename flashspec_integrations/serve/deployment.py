"""The Ray Serve deployment: one engine per replica behind an OpenAI-compatible FastAPI app.

Each replica loads the target once (on the GPU Ray gives it, else the CPU) and routes with its
own router merged with the others' through the shared ledger (`stats`). Every request, streamed
or not, joins the engine's running batch at its next step with its own settings and leaves it
when done (the engine's scheduler); nothing waits for a batch to fill or to finish. Ray restarts
a replica whose process dies; the proxy sends new requests to the live ones meanwhile.

`build_app(args)` is the application builder for Serve config files (`serve run config.yaml`,
docs/serve.md); the CLI (`command.py`) calls it too.

No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (`Request`)
at run time, and Serve's ingress wrapper would leave postponed ones unresolved.
"""
import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from flashspec_integrations.serve import protocol
from flashspec_integrations.serve.protocol import APIError
from flashspec_integrations.serve.stats import share_router
from flashspec_integrations.serve.translate import DeltaStream, Plan, call_info, plan_call, reply_message

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEPLOYMENT_NAME = "FlashSpecServer"


class ServeSettings(BaseModel):
    """What every replica is built with (the `args` of a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(None, description="target model: a folder, .gguf file or cached HF id; None: the embedded default")
    model_name: str | None = Field(None, description="the id clients send as `model`; default: the target's name")
    device: str | None = Field(None, description="None: the replica's GPU if Ray gave it one, else the CPU")
    router_store: str | None = Field(None, description="the shared router ledger (SQLite); None: the default store")
    sync_seconds: float = Field(2.0, ge=0, description="how often a replica merges the others' router statistics")
    max_batch_size: int = Field(8, ge=1, description="rows the engine decodes together; more wait for a slot")
    default_max_tokens: int = Field(512, gt=0, description="new tokens when a request sets no max_tokens")
    threads: int | None = Field(None, gt=0, description="torch CPU threads per replica; None: Ray's CPU share")

    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return DEFAULT_MODEL_NAME if self.target is None else Path(self.target).name or self.target


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


# The engine's argument names (its ValueErrors start with them) -> the request's field names.
_ENGINE_ARGUMENTS = {"max_new_tokens": "max_tokens", "prompt": "messages", "json_schema": "response_format",
                     "stop": "stop", "sampling": None}


def _engine_error(exc: Exception) -> APIError:
    """An engine exception as an API error: its ValueErrors name the argument, so they are 400s."""
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), _ENGINE_ARGUMENTS.get(str(exc).split(":", 1)[0]))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error")


app = FastAPI(title="FlashSpec OpenAI-compatible API")


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
                                                 max_batch=self.settings.max_batch_size)
        self.shared = share_router(self.engine, self.settings.router_store, self.settings.sync_seconds)
        self.model_name = self.settings.served_name()
        self.replica = serve.get_replica_context().replica_id.unique_id

    def _info(self, plan: Plan, stats: Any) -> dict:
        return {**call_info(plan, stats, self.engine.running), "replica": self.replica, "pid": os.getpid(),
                **self.shared.info()}

    def _settings(self, plan: Plan) -> dict[str, Any]:
        """The engine arguments of a planned request."""
        return {"max_new_tokens": plan.max_new_tokens, "sampling": plan.sampling, "stop": list(plan.stop) or None,
                "domain": plan.domain, "json_schema": plan.json_schema}

    def _plan(self, req: protocol.ChatCompletionRequest) -> Plan:
        if req.model != self.model_name:
            raise APIError(404, f"model: {req.model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", code="model_not_found")
        return plan_call(self.engine, req, self.settings.default_max_tokens)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return protocol.model_list(self.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            req = protocol.parse_request(await request.body())
            plan = self._plan(req)
        except APIError as exc:
            return _error(exc)
        cid = protocol.completion_id()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._events(plan, cid, include_usage), media_type="text/event-stream")
        try:
            await asyncio.to_thread(self.shared.sync)
            res = await self.engine.agenerate(plan.prompt_ids, **self._settings(plan))
        except Exception as exc:  # noqa: BLE001 - an OpenAI-style error for this request only
            return _error(_engine_error(exc))
        message, finish, invalid = reply_message(plan, res.text, res.finish_reason)
        info = self._info(plan, res.stats)
        if invalid:
            info["invalid_tool_calls"] = invalid
        body = protocol.completion(cid, self.model_name, message, finish,
                                   protocol.usage(len(plan.prompt_ids), len(res.token_ids)), info)
        return JSONResponse(body)

    async def _events(self, plan: Plan, cid: str, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: the role, content or tool-call deltas, the finish (with the
        `flashspec` field), usage if asked, then [DONE]. A failure mid-stream is sent as an
        `error` event (the status line has gone out already), never a silent end. A client that
        disconnects closes this generator, which cancels the request at the engine's next step."""
        deltas = DeltaStream(plan)
        yield _sse(protocol.chunk(cid, self.model_name, {"role": "assistant", "content": ""}))
        try:
            tokens = 0
            await asyncio.to_thread(self.shared.sync)
            async for piece in self.engine.astream(plan.prompt_ids, **self._settings(plan)):
                tokens += len(piece.token_ids)
                for delta in deltas.feed(piece.text, piece.finish_reason):
                    yield _sse(protocol.chunk(cid, self.model_name, delta))
                if piece.finish_reason is not None:
                    finish = deltas.finish_reason(piece.finish_reason)
                    info = self._info(plan, piece.stats)
                    yield _sse(protocol.chunk(cid, self.model_name, {}, finish, flashspec=info))
            if include_usage:
                yield _sse(protocol.chunk(cid, self.model_name, None, usage=protocol.usage(len(plan.prompt_ids), tokens)))
        except Exception as exc:  # noqa: BLE001 - reported to the client, which must not wait on it
            yield _sse(_engine_error(exc).body())
        yield "data: [DONE]\n\n"


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from Serve config `args` (ServeSettings fields); replicas, autoscaling
    and resources come from the config file's `deployments:` section."""
    return FlashSpecServer.bind(ServeSettings.model_validate(args or {}).model_dump())


def application(settings: ServeSettings, replicas: int | dict, num_cpus: float, num_gpus: float) -> serve.Application:
    """The application with `replicas` fixed replicas (or an autoscaling config dict), each
    holding `num_cpus` CPUs and `num_gpus` GPUs (the CLI's path)."""
    scaling = {"autoscaling_config": replicas} if isinstance(replicas, dict) else {"num_replicas": replicas}
    deployment = FlashSpecServer.options(
        **scaling, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=max(32, 4 * settings.max_batch_size))
    return deployment.bind(settings.model_dump())
