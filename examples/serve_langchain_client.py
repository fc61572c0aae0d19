"""LangChain's stock `ChatOpenAI` against `flashspec-agents serve`: invoke, stream, a forced tool call
and structured output, with no FlashSpec code on the client side.

    flashspec-agents serve --replicas 2          # in another shell; needs the 'serve' extra
    FLASHSPEC_API_KEY=<the server's key> python examples/serve_langchain_client.py --base-url http://127.0.0.1:8000/v1

The server's per-call router statistics (the response's extra `flashspec` field) are read with the
`openai` client in serve_llama_index_client.py.
"""
from __future__ import annotations

import argparse
import os

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}."


class Landmark(BaseModel):
    """Where a landmark is."""

    city: str = Field(description="the city")
    country: str = Field(description="the country")


def main(base_url: str, api_key: str | None = None, max_tokens: int = 48) -> dict:
    api_key = api_key or os.environ.get("FLASHSPEC_API_KEY") or "none"  # the server's --api-key
    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=MODEL, temperature=0, max_tokens=max_tokens)
    reply = llm.invoke("Write one sentence about speculative decoding.")
    streamed = "".join(chunk.content for chunk in llm.stream("Write one sentence about speculative decoding."))
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What's the weather in Paris?")
    where = llm.with_structured_output(Landmark).invoke("Where is the Eiffel tower?")
    print("invoke:  ", reply.content, reply.usage_metadata)
    print("stream:  ", streamed)
    print("tool:    ", call.tool_calls)
    print("schema:  ", where)
    return {"invoke": reply, "stream": streamed, "tool": call, "structured": where}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", help="the server's key (default: $FLASHSPEC_API_KEY)")
    args = parser.parse_args()
    main(args.base_url, args.api_key)
