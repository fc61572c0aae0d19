"""A call the default model chooses to make, on all three surfaces (tool_choice left to the model).

"Turn on the kitchen lights at 80 percent." with `turn_on_lights` and two other suite tools bound
is one of the requests on which SmolLM2-135M-Instruct opens a `<tool_call>` by itself (greedy). Each
surface decodes it under the structural tag of the bound tools, so the call it opens comes out
valid: LangChain `bind_tools`, LlamaIndex `chat_with_tools`, and the server's request translation
with the engine's stream and the reply's parser (the deployment's path, without Ray).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage

from flashspec_core.constrained.tool_suite import TOOL_SUITE
from flashspec_integrations.langchain import ChatFlashSpec
from flashspec_integrations.llama_index import FlashSpecLLM
from flashspec_integrations.serve.protocol import parse_request
from flashspec_integrations.serve.translate import DeltaStream, plan_call, reply_message

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]
BY_NAME = {e["tool"]["function"]["name"]: e for e in TOOL_SUITE}
TOOLS = [BY_NAME[n]["tool"] for n in ("summarize_document", "turn_on_lights", "list_files")]
REQUEST = BY_NAME["turn_on_lights"]["request"]
PARAMETERS = BY_NAME["turn_on_lights"]["tool"]["function"]["parameters"]


def check(name: str, args: dict) -> None:
    assert name == "turn_on_lights"
    jsonschema.validate(args, PARAMETERS)
    assert args["room"] == "kitchen"


def test_langchain(default_engine):
    reply = ChatFlashSpec(max_tokens=96).bind_tools(TOOLS).invoke([HumanMessage(REQUEST)])
    assert len(reply.tool_calls) == 1 and not reply.invalid_tool_calls
    check(reply.tool_calls[0]["name"], reply.tool_calls[0]["args"])
    assert reply.response_metadata["flashspec"]["domain"] == "tool"


def test_llama_index(default_engine):
    llm = FlashSpecLLM(max_tokens=96)
    response = llm.chat_with_tools([t["function"] for t in TOOLS],
                                   chat_history=[ChatMessage(role="user", content=REQUEST)])
    (selection,) = llm.get_tool_calls_from_response(response)
    check(selection.tool_name, selection.tool_kwargs)
    assert "<tool_call>" not in (response.message.content or "")


def test_server(default_engine):
    body = {"model": "m", "messages": [{"role": "user", "content": REQUEST}], "tools": TOOLS, "temperature": 0,
            "max_tokens": 96}
    plan = plan_call(default_engine, parse_request(json.dumps(body).encode()), default_max_tokens=96)
    assert plan.json_schema["type"] == "structural_tag"
    deltas, text, finish = DeltaStream(plan), "", None
    streamed = []
    for chunk in default_engine.stream(plan.prompt_ids, max_new_tokens=plan.max_new_tokens, sampling=plan.sampling,
                                       stop=list(plan.stop) or None, domain=plan.domain, json_schema=plan.json_schema):
        text += chunk.text
        finish = chunk.finish_reason or finish
        streamed += list(deltas.feed(chunk.text, chunk.finish_reason))
    message, finish_reason, invalid = reply_message(plan, text, finish)
    assert finish_reason == "tool_calls" and not invalid
    (call,) = message["tool_calls"]
    check(call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert [d["tool_calls"][0]["function"] for d in streamed if "tool_calls" in d] == [call["function"]]
    assert all("<tool_call>" not in d.get("content", "") for d in streamed)
