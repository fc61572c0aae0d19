"""The request's types are strict: a value of the wrong JSON type is a 400 naming the field, never
coerced; every request that `openai`, LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike` build
still parses (their bodies caught by an HTTP transport: no Ray, no model)."""
from __future__ import annotations

import json

import pytest

from flashspec_integrations.serve.protocol import APIError, parse_request

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

MODEL = "m"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def request(**body):
    return parse_request(json.dumps({"model": MODEL, "messages": HI, **body}).encode())


@pytest.mark.parametrize("body, param, words", [
    ({"stream": "yes"}, "stream", 'valid boolean, not "yes"'),
    ({"stream": 1}, "stream", "valid boolean, not 1"),
    ({"temperature": "0.5"}, "temperature", 'valid number, not "0.5"'),
    ({"top_p": True}, "top_p", "valid number, not true"),
    ({"max_tokens": True}, "max_tokens", "valid integer, not true"),
    ({"max_tokens": 5.0}, "max_tokens", "valid integer, not 5.0"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens", "valid integer"),
    ({"seed": "3"}, "seed", "valid integer"),
    ({"parallel_tool_calls": "false"}, "parallel_tool_calls", "valid boolean"),
    ({"store": 0}, "store", "valid boolean"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
    ({"n": 1.0}, "n", "valid integer, not 1.0"),
    ({"logprobs": 0}, "logprobs", "valid boolean, not 0"),
    ({"presence_penalty": False}, "presence_penalty", "valid number, not false"),
    ({"user": 7}, "user", "valid string, not 7"),
    ({"domain": ["code"]}, "domain", "valid string, not an array"),
])
def test_a_value_of_the_wrong_type_is_a_400_naming_the_field_and_what_was_sent(body, param, words):
    with pytest.raises(APIError) as err:
        request(**body)
    error = err.value.body()["error"]
    assert err.value.status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"n": 2}, "n", "only n=1 is served"),
    ({"logprobs": True}, "logprobs", "leave logprobs unset or false"),
    ({"top_logprobs": 3}, "top_logprobs", "leave top_logprobs unset or 0"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported (only 0)"),
])
def test_values_this_server_cannot_honour_are_refused_with_what_it_can_do(body, param, words):
    with pytest.raises(APIError) as err:
        request(**body)
    assert err.value.param == param and words in err.value.message, err.value.message


def test_an_integer_is_a_number_and_the_neutral_values_pass():
    req = request(temperature=1, top_p=1, n=1, logprobs=False, top_logprobs=0, frequency_penalty=0.0,
                  presence_penalty=0)
    assert (req.temperature, req.top_p) == (1.0, 1.0) and isinstance(req.temperature, float)


def _sent_by_the_openai_client(**kwargs) -> bytes:
    """The body `openai` sends for `chat.completions.create(**kwargs)`, caught before the network."""
    sent: list[bytes] = []
    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        if kwargs.get("stream"):
            return httpx.Response(200, content=b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=reply)

    client = openai.OpenAI(base_url="http://server/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    out = client.chat.completions.create(model=MODEL, **kwargs)
    if kwargs.get("stream"):
        list(out)
    return sent[0]


@pytest.mark.parametrize("kwargs", [
    {"messages": HI},
    {"messages": HI, "temperature": 0.7, "top_p": 0.9, "max_tokens": 16, "seed": 3, "stop": ["\n"], "n": 1,
     "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0.0, "presence_penalty": 0, "user": "u",
     "metadata": {"flashspec_domain": "code"}, "store": False, "extra_body": {"domain": "code"}},
    {"messages": HI, "temperature": 0, "max_completion_tokens": 8, "stop": "END"},
    {"messages": HI, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False},
    {"messages": HI, "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}],
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": WEATHER["function"]["parameters"]}}},
    {"messages": HI, "response_format": {"type": "json_object"}},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *HI,
                  {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]},
])
def test_every_request_the_openai_client_builds_parses(kwargs):
    body = _sent_by_the_openai_client(**kwargs)
    req = parse_request(body)
    sent = json.loads(body)
    assert req.model_dump(by_alias=True, exclude_none=True, include=set(sent) - {"messages"}) == {
        k: v for k, v in sent.items() if k != "messages"}, "a field was changed on the way in"


class _Recorder:
    """An HTTP transport that keeps each request body and answers with one tool call, streamed or not."""

    CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}

    def __init__(self):
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(request.content)
        if json.loads(request.content).get("stream"):
            delta = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **self.CALL}]}
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": "tool_calls"}]}
            return httpx.Response(200, content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
                                  headers={"content-type": "text/event-stream"})
        message = {"role": "assistant", "content": None, "tool_calls": [self.CALL]}
        return httpx.Response(200, json={"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
                                         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def test_what_langchain_and_llama_index_openai_clients_send_parses():
    langchain_openai = pytest.importorskip("langchain_openai")
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    recorder = _Recorder()
    lc = langchain_openai.ChatOpenAI(base_url="http://server/v1", api_key="k", model=MODEL, temperature=0,
                                     max_tokens=48, http_client=httpx.Client(transport=httpx.MockTransport(recorder)))
    lc.invoke("hi")
    list(lc.stream("hi"))
    lc.bind_tools([get_weather], tool_choice="required").invoke("Weather in Rome?")
    li = openai_like.OpenAILike(api_base="http://server/v1", api_key="k", model=MODEL, is_chat_model=True,
                                is_function_calling_model=True, temperature=0, max_tokens=48,
                                http_client=httpx.Client(transport=httpx.MockTransport(recorder)))
    li.chat([ChatMessage(role="user", content="hi")])
    list(li.stream_chat([ChatMessage(role="user", content="hi")]))
    li.chat_with_tools([FunctionTool.from_defaults(get_weather)], "Weather in Rome?", tool_required=True)
    assert len(recorder.bodies) == 6
    for body in recorder.bodies:
        assert parse_request(body).model == MODEL
