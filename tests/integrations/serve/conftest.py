"""One Ray instance and one deployment for every endpoint test of this folder (Ray and two model
loads take most of their time on 2 cores): two CPU replicas of the default model behind an API
key, with a small in-flight limit so that the load test overloads them with a few dozen clients.
"""
from __future__ import annotations

import socket

import pytest

API_KEY = "test-key-7f3a9c"
MODEL = "SmolLM2-135M-Instruct"
MAX_IN_FLIGHT = 4  # per replica
MAX_TOKENS = 64  # the operator's cap: anything a fuzzed request asks for decodes in seconds
# Each replica loads the model and calibrates its kernels before it is up: ~30 s on an idle 2-core
# machine, minutes beside other CPU-heavy work. Past this the folder's tests fail saying so.
READY_TIMEOUT_S = 900.0
BODY_TIMEOUT_S = 8.0  # short, for the stalled-body test; loopback bodies arrive in milliseconds
TEST_DOMAINS = ["code-test", "share-test", "kill-test", "load-test", "disconnect-test", "disconnect-full"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")
def service(default_target, tmp_path_factory):
    """(base URL, ledger path) of two CPU replicas started as the CLI starts them, sharing a router
    ledger that they merge on every call. `default_target` converts the model once first."""
    ray = pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
    serve = pytest.importorskip("ray.serve")
    from flashspec_integrations.serve.command import start
    from flashspec_integrations.serve.limits import Limits

    ledger = tmp_path_factory.mktemp("serve") / "router.sqlite3"
    try:  # Ray workers inherit this process's environment (PYTHONPATH, FLASHSPEC_CACHE_DIR)
        try:
            url = start(2, _free_port(), router_store=str(ledger), sync_seconds=0.0, default_max_tokens=32,
                        api_key=API_KEY, max_in_flight=MAX_IN_FLIGHT, request_timeout_s=120.0,
                        limits=Limits(max_tokens=MAX_TOKENS, domains=TEST_DOMAINS, body_timeout_s=BODY_TIMEOUT_S),
                        ready_timeout_s=READY_TIMEOUT_S)
        except Exception as exc:  # one clear reason for every test of the folder
            pytest.fail(f"the test deployment (two CPU replicas of the default model) did not start: "
                        f"{type(exc).__name__}: {exc}", pytrace=False)
        yield url, ledger
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package")
def client(service):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=service[0], api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="package")
def headers() -> dict[str, str]:
    return {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
