"""`flashspec-agents serve`: start Ray (or join RAY_ADDRESS) and deploy the endpoint.

    flashspec-agents serve --replicas 2 --port 8000

Each replica gets one GPU when the cluster has GPUs, else an equal share of the CPUs (with as many
torch threads). The process stays in the foreground; Ctrl-C shuts the deployment down. For a
multi-host cluster use a Serve config file instead (docs/serve.md). The limits' flags are made from
`limits.Limits`; binding beyond loopback without an API key prints a warning, and with a loopback
`--host` the Ray it starts listens on loopback too (`_init_loopback_ray`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from pydantic import SecretStr, ValidationError

from flashspec_core.memory_plan import MEMORY_FRACTION
from flashspec_integrations.serve.guards import API_KEY_ENV, is_loopback, resolve_api_key
from flashspec_integrations.serve.limits import Limits

APP_NAME = "flashspec"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (one GPU each where there are GPUs)")
    parser.add_argument("--target",
                        help="target model: a folder, .gguf file or cached HF id (default: the embedded model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--model-name", help="the model id clients send (default: the target's name)")
    parser.add_argument("--router-store", help="SQLite file of the router statistics the replicas share")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="rows the engine decodes together; more wait for a slot")
    parser.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                        help="share of the memory free at a replica's start its rows' caches may use (fewer rows "
                             "where --max-batch-size would not fit; replicas sharing a GPU split it)")
    parser.add_argument("--max-context", type=int, help="tokens (prompt + new) one request may hold, below the model's "
                                                        "context window (default: the window); lower, more rows fit")
    parser.add_argument("--api-key", help=f"clients must send it as a Bearer token (default: ${API_KEY_ENV}; "
                                          "none: no key, for loopback only)")
    parser.add_argument("--max-in-flight", type=int, default=64,
                        help="requests in flight per replica; past it a 429 with Retry-After (default 64)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds from a request's arrival to its reply's end; past it a 504 (default 300)")
    limits = parser.add_argument_group("limits of one request (docs/serve.md)")
    for name, field in Limits.model_fields.items():
        flag, shown = "--" + name.replace("_", "-"), field.default if field.default_factory is None else "none"
        if name == "domains":
            limits.add_argument(flag, nargs="+", metavar="DOMAIN", help=field.description)
        else:
            kind = float if field.annotation is float else int
            limits.add_argument(flag, type=kind,
                                help=(field.description or "") + ("" if shown is None else f" (default {shown})"))


def limits_from(args: argparse.Namespace) -> Limits:
    """The `Limits` the flags set (unset flags keep the defaults); ValueError naming the flag."""
    given = {name: getattr(args, name) for name in Limits.model_fields if getattr(args, name, None) is not None}
    try:
        return Limits(**given)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-")
        raise ValueError(f"{flag} {first['msg'].lower()}; got {first.get('input')!r}") from None


def _check(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1; got {args.replicas}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535; got {args.port}")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1; got {args.max_batch_size}")
    if not 0 < args.memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1]; got {args.memory_fraction}")
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"--max-context must be >= 2; got {args.max_context}")
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1; got {args.max_in_flight}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds; got {args.request_timeout}")
    limits_from(args)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for listening beyond this machine without a key, or None."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this port can use the "
            f"server. Set --api-key or ${API_KEY_ENV} (clients send it as their api_key).")


def _init_loopback_ray(**options: Any) -> None:
    """`ray.init` of a new Ray in its single-node mode (its default on macOS and Windows).

    In it the node's address is 127.0.0.1 rather than this machine's network address, and Ray
    binds each listener that it places by the node's address to loopback: GCS, raylet, the
    dashboard and runtime-env agents, the metrics servers, every worker. One Ray Serve listener
    ignores it (docs/serve.md, "Ray's ports"). The mode's switch, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER,
    is read once when Ray is imported into `ray_constants.ENABLE_RAY_CLUSTER`; Ray may be imported
    already, so the constant is set for the `ray.init` and restored after. RuntimeError, with Ray
    shut down, when this Ray version puts the node elsewhere all the same.
    """
    import ray
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} started on {node_ip}, not loopback; refusing to expose its ports "
                           "for a loopback --host (start Ray yourself and set RAY_ADDRESS to use it anyway)")


def start(replicas: int, port: int, host: str = "127.0.0.1", device: str | None = None,
          gpus_per_replica: float = 1.0, ready_timeout_s: float | None = None, **settings: Any) -> str:
    """Start Ray (or join RAY_ADDRESS) and deploy `replicas` replicas; returns the base URL once
    every replica is up (each loads the model and calibrates its kernels first).

    The Ray it starts listens on loopback when `host` is a loopback address, else on every
    interface (Ray's default); a Ray already running (RAY_ADDRESS, or initialized) is used as is.

    Each replica gets `gpus_per_replica` GPUs when the cluster has GPUs (unless `device` is "cpu";
    0.5 puts two replicas on one GPU), else an equal share of the CPUs with as many torch threads.
    `ready_timeout_s`: raise TimeoutError, with what Ray Serve says of the deployment, when the
    replicas are not up by then (None: wait as long as they take). `settings`: further
    `ServeSettings` fields. Ray stays up for the caller to stop (`serve.shutdown()`, `ray.shutdown()`).
    """
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError(f"serve needs Ray Serve ({exc}); "
                         "install it with: pip install 'flashspec-agents[serve]'") from exc

    from flashspec_integrations.serve.deployment import ServeSettings, application

    key = resolve_api_key(settings.pop("api_key", None))
    warning = exposure_warning(host, key)
    if warning:
        print(warning, file=sys.stderr)
    address = os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False)
        elif is_loopback(host):
            _init_loopback_ray(include_dashboard=False, num_cpus=os.cpu_count() or 1)
        else:
            ray.init(include_dashboard=False, num_cpus=os.cpu_count() or 1)
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0) > 0 and device != "cpu"
    if gpus and resources["GPU"] < replicas * gpus_per_replica:
        print(f"warning: {replicas} replicas of {gpus_per_replica:g} GPU but {resources['GPU']:g} GPUs; "
              "the rest wait for a GPU (and this call with them)")
    cpus = 1.0 if gpus else resources.get("CPU", 1) / replicas
    config = ServeSettings(device=device, threads=None if gpus else max(1, int(cpus)),
                           api_key=None if key is None else SecretStr(key), **settings)
    serve.start(http_options={"host": host, "port": port})
    app = application(config, replicas, cpus, gpus_per_replica if gpus else 0)
    _run_within(lambda: serve.run(app, name=APP_NAME, route_prefix="/"), ready_timeout_s)
    return f"http://{host}:{port}/v1"


def _run_within(run: Any, timeout_s: float | None) -> None:
    """`run()` (Ray Serve's deploy-and-wait), or TimeoutError naming the deployment's state once
    `timeout_s` passes (the deploy goes on in the background; the caller shuts Serve down)."""
    if timeout_s is None:
        run()
        return
    failed: list[BaseException] = []

    def deploy() -> None:
        try:
            run()
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=deploy, name="flashspec-deploy", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failed:
        raise failed[0]
    if thread.is_alive():
        from ray import serve

        app = serve.status().applications.get(APP_NAME)
        state = "; ".join(f"{name}: {d.status.value} {d.message}".strip()
                          for name, d in (app.deployments.items() if app else ())) or "not deployed yet"
        raise TimeoutError(f"the deployment's replicas were not up within {timeout_s:g} s ({state})")


def cmd_serve(args: argparse.Namespace) -> int:
    _check(args)
    url = start(args.replicas, args.port, args.host, target=args.target, model_name=args.model_name,
                router_store=args.router_store, max_batch_size=args.max_batch_size, api_key=args.api_key,
                memory_fraction=args.memory_fraction, max_context=args.max_context,
                max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout, limits=limits_from(args))
    print(f"serving {args.replicas} replica(s) at {url} (OpenAI API: POST {url}/chat/completions); Ctrl-C stops")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job ignores it by default
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    from ray import serve

    serve.shutdown()
    return 0
