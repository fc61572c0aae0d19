"""`flashspec-agents serve`: start Ray (or join RAY_ADDRESS) and deploy the endpoint.

    flashspec-agents serve --replicas 2 --port 8000

Each replica gets one GPU when the cluster has GPUs, else an equal share of the CPUs (with as many
torch threads). The process stays in the foreground; Ctrl-C shuts the deployment down. For a
multi-host cluster use a Serve config file instead (docs/serve.md).
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

APP_NAME = "flashspec"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (one GPU each where there are GPUs)")
    parser.add_argument("--target", help="target model: a folder, .gguf file or cached HF id (default: the embedded model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--model-name", help="the model id clients send (default: the target's name)")
    parser.add_argument("--router-store", help="SQLite file of the router statistics the replicas share")
    parser.add_argument("--max-batch-size", type=int, default=8, help="rows the engine decodes together; more wait for a slot")


def _check(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1; got {args.replicas}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535; got {args.port}")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1; got {args.max_batch_size}")


def start(replicas: int, port: int, host: str = "127.0.0.1", device: str | None = None,
          gpus_per_replica: float = 1.0, **settings: Any) -> str:
    """Start Ray (or join RAY_ADDRESS) and deploy `replicas` replicas; returns the base URL.

    Each replica gets `gpus_per_replica` GPUs when the cluster has GPUs (unless `device` is "cpu";
    0.5 puts two replicas on one GPU), else an equal share of the CPUs with as many torch threads.
    `settings`: further `ServeSettings` fields.
    Ray stays up for the caller to stop (`serve.shutdown()`, `ray.shutdown()`).
    """
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError(f"serve needs Ray Serve ({exc}); install it with: pip install 'flashspec-agents[serve]'") from exc

    from flashspec_integrations.serve.deployment import ServeSettings, application

    address = os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        ray.init(address=address or None, include_dashboard=False,
                 **({} if address else {"num_cpus": os.cpu_count() or 1}))
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0) > 0 and device != "cpu"
    if gpus and resources["GPU"] < replicas * gpus_per_replica:
        print(f"warning: {replicas} replicas of {gpus_per_replica:g} GPU but {resources['GPU']:g} GPUs; "
              "the rest wait for a GPU (and this call with them)")
    cpus = 1.0 if gpus else resources.get("CPU", 1) / replicas
    config = ServeSettings(device=device, threads=None if gpus else max(1, int(cpus)), **settings)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(config, replicas, cpus, gpus_per_replica if gpus else 0), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}/v1"


def cmd_serve(args: argparse.Namespace) -> int:
    _check(args)
    url = start(args.replicas, args.port, args.host, target=args.target, model_name=args.model_name,
                router_store=args.router_store, max_batch_size=args.max_batch_size)
    print(f"serving {args.replicas} replica(s) at {url} (OpenAI API: POST {url}/chat/completions); Ctrl-C stops")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job ignores it by default
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    from ray import serve

    serve.shutdown()
    return 0
