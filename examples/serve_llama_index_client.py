"""LlamaIndex's stock `OpenAILike` against `flashspec-agents serve`: chat, streaming, a forced tool
call and structured output, plus the server's per-call router statistics read with `openai`.

    flashspec-agents serve --replicas 2          # in another shell; needs the 'serve' extra
    FLASHSPEC_API_KEY=<the server's key> python examples/serve_llama_index_client.py --base-url http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import os

from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from openai import OpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}."


class Landmark(BaseModel):
    """Where a landmark is."""

    city: str = Field(description="the city")
    country: str = Field(description="the country")


def main(base_url: str, api_key: str | None = None, max_tokens: int = 48) -> dict:
    api_key = api_key or os.environ.get("FLASHSPEC_API_KEY") or "none"  # the server's --api-key
    llm = OpenAILike(api_base=base_url, api_key=api_key, model=MODEL, is_chat_model=True,
                     is_function_calling_model=True, context_window=8192, temperature=0, max_tokens=max_tokens)
    question = [ChatMessage(role="user", content="Write one sentence about speculative decoding.")]
    reply = llm.chat(question)
    streamed = "".join(r.delta or "" for r in llm.stream_chat(question))
    response = llm.chat_with_tools([FunctionTool.from_defaults(get_weather)], user_msg="What's the weather in Paris?",
                                   tool_required=True)
    calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    where = llm.structured_predict(Landmark, PromptTemplate("Where is {landmark}?"), landmark="the Eiffel tower")
    # The `flashspec` field of a response: the call's domain, the arms its steps used, the replica.
    raw = OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a Python function fibonacci(n)."}], max_tokens=16,
        temperature=0)
    stats = raw.model_extra["flashspec"]
    print("chat:    ", reply.message.content)
    print("stream:  ", streamed)
    print("tool:    ", [(c.tool_name, c.tool_kwargs) for c in calls])
    print("schema:  ", where)
    print("router:  ", {k: stats[k] for k in ("domain", "domain_source", "arms", "acceptance_rate", "replica")})
    return {"chat": reply, "stream": streamed, "tool_calls": calls, "structured": where, "stats": stats}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", help="the server's key (default: $FLASHSPEC_API_KEY)")
    args = parser.parse_args()
    main(args.base_url, args.api_key)
