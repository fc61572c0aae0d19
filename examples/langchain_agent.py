"""A tool-calling agent (langchain.agents.create_agent) with two real Python tools, fully offline.

    python examples/langchain_agent.py [--max-tokens 40] [question ...]
    python examples/langchain_agent.py --target path/to/Qwen2.5-1.5B-Instruct --auto-tools [question ...]

The agent's model is ChatFlashSpec over the embedded default model. Each model call prints the
router domain it reached and the draft chosen: the step that must pick a tool is a forced call
(domain "json": a call of one of the two tools, decoded under the tools' schemas), the step that
reads the tool's result and answers is "tool/result". The default model has 135M parameters and
rarely calls a tool on its own (benchmarks/auto_tool_calls.py), so a middleware keeps the loop
short and deterministic: the first model call must call a tool (the model picks which, from the
tools' descriptions, and writes the arguments from the question), the call after a tool result
must answer in words. A larger target of your own (`--target`, a local folder or cached HF id)
can drop that middleware (`--auto-tools`): the model then decides when to call, and a call it
opens is still decoded under the tools' schemas.
"""
from __future__ import annotations

import argparse
import ast
import operator
from collections.abc import Callable, Sequence
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, wrap_model_call
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool

try:
    from langchain_steps import StepPrinter
except ImportError:  # imported as examples.langchain_agent
    from examples.langchain_steps import StepPrinter

QUESTIONS = ["What is 17 * 23?", "How many words are in the sentence 'the cat sat on the mat'?"]
SYSTEM = "You are a helpful assistant. Use a tool when it helps, then answer in one short sentence."

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.Mod: operator.mod,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers and + - * / ** % are allowed")


# The descriptions say what each tool is for with an example: with "Evaluate an arithmetic expression
# such as '17 * 23'" and "Count the words in a text", the default model called the calculator to
# count words.
@tool
def calculator(expression: str) -> str:
    """Evaluate arithmetic on numbers, such as '17 * 23'."""
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


@tool
def word_count(text: str) -> int:
    """Count how many words a text has, such as 'the cat sat' (3 words)."""
    return len(text.split())


@wrap_model_call
def one_tool_then_answer(request: ModelRequest, handler):
    """Force a tool call until a tool has answered, then forbid tools so the model answers."""
    answered = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(request.override(tool_choice="none" if answered else "any"))


def build_agent(llm: BaseChatModel, force_tools: bool = True):
    middleware = [one_tool_then_answer] if force_tools else []
    return create_agent(llm, [calculator, word_count], system_prompt=SYSTEM, middleware=middleware, name="helper")


def main(argv: Sequence[str] | None = None, llm: BaseChatModel | None = None) -> list[dict]:
    """Runs the agent on each question; returns the recorded model steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--target", default=None, help="a target of your own: local folder, .gguf or cached HF id")
    parser.add_argument("--auto-tools", action="store_true", help="let the model choose when to call a tool")
    parser.add_argument("questions", nargs="*", default=QUESTIONS)
    args = parser.parse_args(argv)
    if llm is None:
        from flashspec_integrations.langchain import ChatFlashSpec

        llm = ChatFlashSpec(target=args.target, max_tokens=args.max_tokens)
    agent = build_agent(llm, force_tools=not args.auto_tools)
    printer = StepPrinter()
    for question in args.questions:
        print(f"Q: {question}")
        state = agent.invoke({"messages": [("user", question)]}, config={"callbacks": [printer], "recursion_limit": 8})
        for m in state["messages"]:
            if isinstance(m, ToolMessage):
                print(f"  tool {m.name} -> {m.content}")
        print(f"  A: {str(state['messages'][-1].content).strip()}")
    return printer.steps


if __name__ == "__main__":
    main()
