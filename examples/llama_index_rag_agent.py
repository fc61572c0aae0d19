"""A LlamaIndex RAG agent: a search tool over local documents plus a Python tool (offline).

    python examples/llama_index_rag_agent.py
    python examples/llama_index_rag_agent.py "How many loaves does the Copper Kettle bake in a week?"
    python examples/llama_index_rag_agent.py --target path/to/Qwen2.5-1.5B-Instruct "How long does the
        battery of the Orbit-7 robot last over two full charges?"

A `FunctionAgent` gets two tools: `search_docs` (a query engine over examples/docs) and
`calculate` (plain Python arithmetic). Its first step is steered to `search_docs`
(`initial_tool_choice`), so even the small default model starts from the documents; the call is
decoded under the tool's schema, and the model copies the user's question into it (the parameter
is called `question` and the tool says what it searches: with QueryEngineTool's undescribed
`input`, the default model wrote "str"). The default model (135M) does not go on from a tool's
result: with tools listed it ends its turn at once, without a word, so on it the search tool
returns the answer it synthesised from the documents (`return_direct`) and the default question
is one search answers. A target of your own (`--target`) reads the result and may calculate.
The script prints every LLM call with its domain and the draft the router used: the forced call
(`json`), the synthesis inside the query engine (`rag`), and, on a larger target, the steps that
read tool results (`tool/result`).
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import operator
from collections.abc import Sequence
from pathlib import Path

from llama_index.core import Settings
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool

from flashspec_integrations.llama_index import FlashSpecLLM, record_steps

try:  # run as a script (examples/ on sys.path) or imported as examples.llama_index_rag_agent
    from llama_index_rag_query_engine import DOCS, build_query_engine
except ImportError:  # imported as a module of the examples package
    from examples.llama_index_rag_query_engine import DOCS, build_query_engine

QUESTION = "How long does the battery of the Orbit-7 robot last on one charge?"
SYSTEM_PROMPT = (
    "You answer questions about local documents. Search the documents first, then use the "
    "calculate tool for any arithmetic, then give a short answer."
)
_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as '95 * 2' and return the result."""
    try:
        value = _evaluate(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: cannot evaluate {expression!r} ({exc})"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def search_tool(docs_dir: Path, return_direct: bool) -> FunctionTool:
    query_engine = build_query_engine(docs_dir)

    def search_docs(question: str) -> str:
        """Search the local documents (festival, river, bakery, vacuum robot) for the answer to a question."""
        return str(query_engine.query(question)).strip()

    return FunctionTool.from_defaults(search_docs, return_direct=return_direct)


def build_agent(docs_dir: Path = DOCS, max_tokens: int = 64, target: str | None = None) -> FunctionAgent:
    Settings.llm = FlashSpecLLM(target=target, max_tokens=max_tokens)
    return FunctionAgent(
        tools=[search_tool(docs_dir, return_direct=target is None), FunctionTool.from_defaults(calculate)],
        llm=Settings.llm,
        system_prompt=SYSTEM_PROMPT,
        initial_tool_choice="search_docs",
    )


async def run(question: str, agent: FunctionAgent, max_iterations: int) -> tuple[str, list[tuple[str, dict]]]:
    """Run the agent; returns its answer and the tools it called with their arguments, in order."""
    handler = agent.run(user_msg=question, max_iterations=max_iterations)
    called = []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            called.append((event.tool_name, dict(event.tool_kwargs)))
            print(f"tool {event.tool_name}({event.tool_kwargs}) -> {str(event.tool_output.content)[:80]!r}")
    return str(await handler), called


def main(argv: Sequence[str] | None = None) -> tuple[str, list[tuple[str, dict]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--docs", type=Path, default=DOCS, help="folder of documents to index")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-iterations", type=int, default=6)
    parser.add_argument("--target", default=None, help="a target of your own: local folder, .gguf or cached HF id")
    args = parser.parse_args(argv)

    agent = build_agent(args.docs, args.max_tokens, args.target)
    with record_steps() as recorder:
        answer, called = asyncio.run(run(args.question, agent, args.max_iterations))
    for i, step in enumerate(recorder.steps, 1):
        print(f"step {i}: {step.describe()}")
    print(f"question: {args.question}")
    print(f"answer: {answer.strip()}")
    return answer, called


if __name__ == "__main__":
    main()
