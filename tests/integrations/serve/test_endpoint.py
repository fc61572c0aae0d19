"""The endpoint end to end: Ray started here, two CPU replicas of the default model, real clients
(the deployment is this folder's `service` fixture, conftest.py)."""
from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest

from .conftest import API_KEY, MODEL

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def ask(client, content: str, domain: str | None = None, **kw):
    """One chat completion; `domain` goes in the request's extra field, as a client would send it."""
    extra = {"extra_body": {"domain": domain}} if domain else {}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          **{"max_tokens": 16, "temperature": 0, **extra, **kw})


def test_openai_client_gets_the_engines_own_greedy_output(client, default_target):
    from flashspec_core import SpecEngine

    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = "Write a haiku about caches."
    res = ask(client, prompt)
    local = SpecEngine.from_default().generate([{"role": "user", "content": prompt}], max_new_tokens=16)
    assert res.choices[0].message.content == local.text  # the server renders and decodes as in-process
    assert res.usage.completion_tokens == len(local.token_ids) and res.usage.prompt_tokens == local.prompt_tokens
    assert res.choices[0].finish_reason == local.finish_reason
    info = res.model_extra["flashspec"]
    assert info["domain"] == "chat" and info["domain_source"] == "classifier"
    assert sum(info["arms"].values()) == info["steps"] > 0 and info["replica"] and info["pid"]

    chunks = list(ask(client, prompt, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == local.text and len(chunks) > 3
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[-1].choices[0].finish_reason == local.finish_reason
    assert finish[-1].model_extra["flashspec"]["steps"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(local.token_ids)


def test_forced_tool_call_and_json_schema_through_openai_client(client):
    res = ask(client, "What's the weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=48)
    call = res.choices[0].message.tool_calls[0]
    assert res.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}  # decoded under the call's schema
    assert res.model_extra["flashspec"]["domain"] == "json"
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    res = ask(client, "What is 2 + 3?", max_tokens=24,
              response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})
    assert isinstance(json.loads(res.choices[0].message.content)["answer"], int)
    res = ask(client, "def add(a, b):", domain="code-test", metadata={"langgraph_node": "coder"})
    assert res.model_extra["flashspec"]["domain"] == "code-test"
    assert res.model_extra["flashspec"]["agent_node"] == "coder"


def example(name: str):
    """An example script as a module: its `main(base_url)` runs it against the test service."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_langchain_chat_openai_unchanged(service):
    lc = example("serve_langchain_client")
    out = lc.main(service[0], API_KEY, max_tokens=48)
    assert out["invoke"].content and out["invoke"].usage_metadata["output_tokens"] > 0
    assert out["stream"] == out["invoke"].content  # greedy: the stream is the same text
    assert out["tool"].tool_calls[0]["name"] == "get_weather" and "city" in out["tool"].tool_calls[0]["args"]
    assert out["structured"].city and out["structured"].country

    llm = lc.ChatOpenAI(base_url=service[0], api_key=API_KEY, model=MODEL, temperature=0, max_tokens=48)
    streamed = None
    for chunk in llm.bind_tools([lc.get_weather], tool_choice="required").stream("Weather in Rome?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "get_weather"
    landmark = llm.with_structured_output(lc.Landmark, method="function_calling").invoke("Where is Big Ben?")
    assert isinstance(landmark, lc.Landmark) and landmark.city


def test_llama_index_openai_like_unchanged(service):
    out = example("serve_llama_index_client").main(service[0], API_KEY, max_tokens=48)
    assert out["chat"].message.content and out["stream"] == out["chat"].message.content
    assert out["tool_calls"][0].tool_name == "get_weather" and "city" in out["tool_calls"][0].tool_kwargs
    assert out["structured"].city and out["structured"].country
    assert out["stats"]["domain"] == "code"


@pytest.mark.parametrize("body, status, param, words", [
    (b'{"model": "' + MODEL.encode() + b'", "messages": [', 400, None, "not valid JSON"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "not served here"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens", "greater than 0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     400, "response_format", "cannot compile"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}],
      "tool_choice": "required"}, 400, "tools", "cannot compile"),
    ({"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     400, "tool_choice", "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "n=1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperatur": 1},
     400, "temperatur", "unrecognized"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6},
     400, "max_tokens", "at most 64"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 8150}], "max_tokens": 60},
     400, "max_tokens", "context window"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.005},
     400, "temperature", "at least 0.01"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": -1},
     400, "seed", "greater than or equal to 0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 64},
     400, "seed", "less than 18446744073709551616"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "domain": "made-up"},
     400, "domain", "not a router domain"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "metadata": {"flashspec_domain": "x"}},
     400, "metadata.flashspec_domain", "not a router domain"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 1025}, 400, "messages", "at most 1024"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 17}, 400, "stop", "at most 16"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "\n" * 200_000}]}, 400, "messages", "characters"),
])
def test_malformed_requests_get_openai_style_4xx(service, headers, body, status, param, words):
    url = service[0] + "/chat/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    res = httpx.post(url, headers=headers, timeout=60, **kwargs)
    error = res.json()["error"]
    assert res.status_code == status and error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_service_stays_up_after_bad_requests_and_the_client_sees_the_field(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        ask(client, "hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert ask(client, "Say hi.").choices[0].message.content


def _by_replica(client, n: int, domain: str) -> dict[int, list[dict]]:
    seen: dict[int, list[dict]] = {}
    for i in range(n):
        info = ask(client, f"Tell me fact number {i} about rivers.", domain=domain,
                   max_tokens=8).model_extra["flashspec"]
        seen.setdefault(info["pid"], []).append(info)
    return seen


def test_two_replicas_share_router_statistics(client, service):
    seen = _by_replica(client, 16, "share-test")
    assert len(seen) == 2, "the proxy sent every request to one replica"
    for infos in seen.values():  # each replica, once the other had run, absorbed its steps
        later = [i for i in infos if i["peer_steps"] > 0]
        assert later, infos
    with sqlite3.connect(service[1]) as db:  # no step lost or counted twice in the ledger
        (pulls,) = db.execute("SELECT SUM(pulls) FROM arm_stats WHERE domain = 'share-test'").fetchone()
    # A request's first step (its first token from the prefill's forward) rewards no arm.
    assert pulls == sum(i["steps"] - 1 for infos in seen.values() for i in infos)
