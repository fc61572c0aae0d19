"""Fuzzing the real server with request bodies (hypothesis): wrong types, missing and extra fields,
huge and empty values, deep schemas, odd unicode, thousands of messages, bodies that are not JSON.

Every answer must be a 2xx or a 4xx in OpenAI's error shape (a stream must not carry a server
error event either), and the server must answer a normal request afterwards. The cases are drawn
from a fixed seed (`derandomize`), so a failure reproduces; their count is printed and asserted.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from .conftest import MODEL

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = 500  # about a minute against two CPU replicas

# Any JSON value, including the ones that break naive code: big and negative ints, floats at the
# edges (JSON has no NaN nor infinity: json.dumps writes them anyway, as a careless client would).
scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True)
           | st.text(max_size=20) | st.sampled_from(["", " ", "\x00", "\ud800", "🦜" * 3, "\u202e", "﷽"]))
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)
odd_text = st.text(st.characters(codec="utf-8"), max_size=60) | st.sampled_from(
    ["", "\n" * 5000, " " * 3000, "Context:\n" * 300, "\x00\x01", "😀" * 500, "a" * 20_000, "\ud83d"])
HUGE = {"x" * (5 << 20)}  # past the body limit: a 413


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"k": schema}, "required": ["k"]}
    return schema


schemas = st.one_of(
    st.integers(0, 40).map(nested_schema),
    st.sampled_from([{"type": "object"}, {"type": "strin"}, {"$ref": "#/nope"}, {"type": "string", "pattern": "("},
                     {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1},
                     {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
                     {"enum": list(range(2000))}, {"anyOf": []}, {}]),
    json_values,
)
roles = st.sampled_from(["user", "system", "assistant", "developer", "tool", "function"]) | st.text(max_size=6)
messages = st.fixed_dictionaries(
    {"role": roles,
     "content": odd_text | st.none() | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": odd_text}), max_size=3)},
    optional={"name": st.text(max_size=10), "tool_call_id": st.text(max_size=10), "tool_calls": json_values},
)
message_lists = st.one_of(
    st.lists(messages, min_size=0, max_size=4),
    st.integers(900, 3000).map(lambda n: [{"role": "user", "content": "hi"}] * n),  # thousands
    json_values,
)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | st.text(max_size=5),
                                        "function": st.fixed_dictionaries(
                                            {"name": st.text(max_size=12)},
                                            optional={"parameters": schemas, "description": odd_text})})
                 | json_values, max_size=3)

# The fields of a request and, for each, values right and wrong.
FIELDS: dict[str, Any] = {
    "model": st.just(MODEL) | st.text(max_size=10) | json_values,
    "messages": message_lists,
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required", "any"]) | json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
                                              "json_schema": st.fixed_dictionaries({"name": st.text(max_size=5),
                                                                                    "schema": schemas})})
                       | json_values,
    "stop": st.lists(odd_text, max_size=20) | odd_text | json_values,
    "max_tokens": st.integers(1, 3) | st.integers(-5, 10 ** 6) | json_values,
    "max_completion_tokens": st.integers(-2, 100) | json_values,
    "temperature": st.sampled_from([0, 0.005, 0.01, 1.0, 2.0, 2.5, -1]) | st.floats(allow_nan=True) | json_values,
    "top_p": st.floats(allow_nan=True) | json_values,
    "seed": st.sampled_from([0, -1, 2 ** 64 - 1, 2 ** 64, 2 ** 100]) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "logprobs": st.booleans() | json_values,
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600) | json_values, max_size=20) | json_values,
    "domain": st.sampled_from(["code", "Chat", " ", "", "../../etc", "x" * 10_000]) | json_values,
    "user": st.text(max_size=10) | json_values,
    "parallel_tool_calls": st.booleans() | json_values,
}


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A request body: mostly a JSON object near a valid request, sometimes anything at all."""
    kind = draw(st.sampled_from(["request"] * 8 + ["json", "bytes", "huge", "deep"]))
    if kind == "deep":  # JSON nested past any parser's recursion limit, at the top or inside a field
        depth = draw(st.sampled_from([64, 1000, 100_000]))
        nest = "[" * depth + "]" * depth
        inside = [f'{{"model": "{MODEL}", "messages": {nest}}}',
                  f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
                  f'"metadata": {{"a": {nest}}}}}']
        return draw(st.sampled_from([nest, *inside])).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "huge":
        return json.dumps({"model": MODEL,
                           "messages": [{"role": "user", "content": draw(st.sampled_from(sorted(HUGE)))}]}).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(FIELDS[name])
    for name in draw(st.lists(st.sampled_from(["model", "messages", "max_tokens"]), max_size=2, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            body.pop(name, None)  # missing
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)  # an extra field
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes


def test_no_request_body_gets_a_5xx_and_the_server_answers_afterwards(service, headers, client):
    url = service[0] + "/chat/completions"
    seen: Counter[int] = Counter()
    http = httpx.Client(timeout=120, headers=headers)

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(body=bodies())
    def case(body: bytes) -> None:
        res = http.post(url, content=body)
        seen[res.status_code] += 1
        assert res.status_code < 500, (res.status_code, res.text[:500], body[:300])
        if res.status_code >= 400:
            error = res.json()["error"]
            assert error["message"] and error["type"], res.text[:300]
        elif res.headers.get("content-type", "").startswith("text/event-stream"):
            assert "server_error" not in res.text and res.text.rstrip().endswith("data: [DONE]"), res.text[-500:]
        else:
            assert res.json()["choices"][0]["message"]["role"] == "assistant"

    try:
        case()
    finally:
        http.close()
        print(f"\nfuzz: {sum(seen.values())} request bodies, answers by status {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= CASES and seen[200] > 0 and seen[400] > 0 and seen[413] > 0
    res = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=8, temperature=0)
    assert res.choices[0].message.content and res.usage.completion_tokens > 0
