"""An unforced LangGraph agent loop (tool_choice "auto") runs to completion on ChatFlashSpec.

The default 135M model never calls a tool unforced (0 of 50 requests: benchmarks/auto_tool_calls.py),
so the model here is scripted to do what a larger target does: call the tool in the Hermes format
the prompt asks for, read the result, answer. What is under test is the adapter's side of the loop:
the call parsed into `tool_calls` with an id, the graph routing to the tool, the tool's result
rendered back into the next prompt, the answer ending the loop, each step filed under its domain.
"""
from __future__ import annotations

import pytest
from fakes import ScriptedEngine
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from flashspec_integrations.langchain import ChatFlashSpec

CALLS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLS.append(city)
    return f"Sunny and 24 C in {city}."


def weather_model(prompt: str) -> str:
    """Calls the tool until its result is in the prompt, then answers from it."""
    if "<tool_response>" not in prompt:
        return ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '</tool_call>')
    return "It is sunny and 24 C in Paris."


def raw_graph(model):
    bound = model.bind_tools([get_weather])  # tool_choice "auto": nothing forces a call

    def agent(state: MessagesState):
        return {"messages": [bound.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@pytest.mark.parametrize("build", [raw_graph, lambda m: create_agent(m, [get_weather])],
                         ids=["StateGraph", "create_agent"])
def test_unforced_agent_loop_calls_the_tool_and_finishes(build):
    CALLS.clear()
    engine = ScriptedEngine(weather_model)
    state = build(ChatFlashSpec(engine=engine)).invoke({"messages": [("user", "What's the weather in Paris?")]},
                                                       config={"recursion_limit": 6})
    messages = state["messages"]
    assert CALLS == ["Paris"]
    first, result, answer = messages[1], messages[2], messages[-1]
    assert isinstance(first, AIMessage) and first.tool_calls[0]["name"] == "get_weather"
    assert isinstance(result, ToolMessage) and result.tool_call_id == first.tool_calls[0]["id"]
    assert (isinstance(answer, AIMessage) and not answer.tool_calls
            and answer.content == "It is sunny and 24 C in Paris.")
    # Never forced: each step may call or answer, under the structural tag of the bound tool's calls.
    assert len(engine.calls) == 2 and all(c["json_schema"]["format"]["triggers"] == ["<tool_call>"]
                                          and not c["json_schema"]["format"]["at_least_one"] for c in engine.calls)
    assert [c["label"] for c in engine.calls] == ["tool", "tool/result"]
    assert "<tool_response>\nSunny and 24 C in Paris.\n</tool_response>" in engine.calls[1]["prompt"]
