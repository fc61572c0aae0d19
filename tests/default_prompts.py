"""The default model's test prompts: ten chat requests of different kinds (chat, multi-turn, code, a
code edit, a tool call, RAG over a short document, math, a list, JSON extraction, a summary) that the
greedy tests on every runner decode, and the document they quote."""
from __future__ import annotations

DOC = (
    "Northwind Rail operates three lines. The Red Line runs every 10 minutes from 5:30 to 23:30 and "
    "connects Harbor Station with Airport Terminal in 42 minutes. The Blue Line runs every 15 minutes "
    "and serves the university campus. The Green Line is closed for maintenance until 14 June. Tickets "
    "cost 2.40 EUR for a single ride and 7.50 EUR for a day pass; children under 6 travel free."
)
TOOLS = (
    '[{"name": "get_weather", "description": "Current weather for a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, '
    '"required": ["city"]}}]'
)
PROMPTS = {
    "chat": [{"role": "user", "content": "Hi! Can you suggest three fun things to do on a rainy weekend?"}],
    "multi_turn": [
        {"role": "user", "content": "What is the tallest mountain in the world?"},
        {"role": "assistant", "content": "Mount Everest, at about 8,849 metres."},
        {"role": "user", "content": "And how long does it usually take to climb it?"},
    ],
    "code": [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number "
                                         "iteratively, with a docstring and type hints."}],
    "code_edit": [{"role": "user", "content": "Fix the bug in this function and explain the fix:\n```python\n"
                                              "def average(values):\n    total = 0\n    for v in values:\n"
                                              "        total += v\n    return total / len(values) + 1\n```"}],
    "tool": [
        {"role": "system", "content": "You can call tools. Available tools: " + TOOLS + "\nTo call a tool, reply "
                                      'only with JSON like {"name": ..., "arguments": {...}}.'},
        {"role": "user", "content": "What's the weather in Paris right now, in celsius?"},
    ],
    "rag": [{"role": "user", "content": "Answer using only this document.\n\n" + DOC + "\n\nQuestion: How long "
                                        "does the Red Line take to the airport, and what does a day pass cost?"}],
    "math": [{"role": "user", "content": "Solve step by step: a train travels 120 km in 1.5 hours. "
                                         "What is its average speed in km/h?"}],
    "list": [{"role": "user", "content": "List the planets of the solar system in order from the sun, one per line."}],
    "json_extract": [{"role": "user", "content": "Extract name, age and city as a JSON object from: "
                                                 "'Maria, 34, lives in Lisbon and works as a nurse.'"}],
    "summary": [{"role": "user", "content": "Summarize in two sentences:\n\n" + DOC}],
}
