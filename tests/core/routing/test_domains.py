"""Domain resolution: precedence, normalisation, the prompt classifier, and its cost."""
from __future__ import annotations

import time

import pytest
from helpers import needs_sharegpt

from flashspec_core.routing import classify_prompt, resolve_domain

_DOCS = "\n\n".join(
    f"Document {i}: The municipal water board reported that reservoir levels in district {i} "
    "fell by eleven percent over the summer, prompting new irrigation limits for farms and "
    "a public campaign on household use. Officials expect partial recovery after the autumn rains."
    for i in range(1, 16)
)

PROMPTS = {
    "chat": [
        "Good morning! Could you help me plan a relaxing weekend in Lisbon?",
        "My sister keeps borrowing my clothes without asking. How should I bring it up kindly?",
        "Summarise the plot of Pride and Prejudice in three sentences.",
        "What are some good names for a golden retriever puppy?",
        "Translate 'where is the train station' into German and Italian.",
        "Write a haiku about the first snow of winter.",
        "I feel anxious before presentations -> any tips to calm down?",
    ],
    "code": [
        "```js\nconst xs = [3, 1, 2];\nxs.sort((a, b) => a - b);\nconsole.log(xs);\n```\n"
        "Why does sort without a comparator give the wrong order for numbers?",
        "Implement a Rust function that returns the nth Fibonacci number iteratively.",
        "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value.strip()\n\n"
        "This crashes on lines without '='; fix it.",
        "SELECT name, COUNT(*) FROM orders o JOIN users u ON u.id = o.user_id GROUP BY name;\n"
        "How can I make this SQL query faster?",
        "Traceback (most recent call last):\n  File \"app.py\", line 12, in <module>\n    main()\nKeyError: 'user'\n",
        "public class Main {\n    public static void main(String[] args) {\n        System.out.println(\"hi\");\n"
        "    }\n}\nConvert this Java program to Kotlin.",
    ],
    "tool": [
        '{"name": "search_flights", "arguments": {"from": "OSL", "to": "LIS", "date": "2025-06-01"}}',
        "<tool_call>\n{\"name\": \"get_stock_price\", \"arguments\": {\"ticker\": \"NVDA\"}}\n</tool_call>",
        "Answer the question. You have access to the following tools:\ncalculator: evaluates arithmetic\n"
        "wiki: looks up articles\n\nQuestion: how tall is Mont Blanc?\nThought: I should look it up.\n"
        "Action: wiki\nAction Input: Mont Blanc\nObservation: 4,806 m",
        '{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", '
        '"function": {"name": "send_email", "arguments": "{}"}}]}',
    ],
    "json": [
        "Read the review below and output JSON with fields sentiment and score.\nReview: The soup was cold.",
        "Give me a valid JSON object describing a book: title, author, year.",
        'Conform to this: {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
    ],
    "rag": [
        _DOCS + "\n\nQuestion: By how much did reservoir levels fall? Answer using only the documents above.",
        "Context:\n"
        + "The Treaty of Westphalia (1648) ended the Thirty Years' War and reshaped the map of Europe. " * 60
        + "\nWhat did the treaty end?",
        "Use the provided passages to answer and cite the passage numbers.\n\n"
        "[1] Honeybees communicate through a waggle dance.\n[2] The dance encodes direction and distance.\n\n"
        "Q: How do bees share locations?",
    ],
    "math": [
        "Solve the system: 2x + y = 7 and x - y = 2.",
        "Find the derivative of f(x) = x^3 - 4x + 1.",
        "How many prime numbers are there between 1 and 50?",
        "Evaluate $\\frac{3}{4} + \\frac{5}{6}$ and simplify the result.",
        "A triangle has sides 5, 12 and 13. What is its area?",
    ],
}
CASES = [(label, p) for label, prompts in PROMPTS.items() for p in prompts]


@pytest.mark.parametrize("label, prompt", CASES, ids=[f"{l}-{i}" for i, (l, _) in enumerate(CASES)])
def test_classifier_labels_varied_prompts(label, prompt):
    assert classify_prompt(prompt) == label


def test_classifier_is_right_on_nearly_all_prompts():
    """Guards the overall rate too, so one relaxed case above cannot hide a broad regression."""
    right = sum(classify_prompt(p) == label for label, p in CASES)
    assert right / len(CASES) >= 0.95


@pytest.mark.parametrize("prompt", ["", "   ", "\n\n", "?", "ok"])
def test_degenerate_prompts_are_chat(prompt):
    assert classify_prompt(prompt) == "chat"


def test_explicit_beats_hint_beats_classifier():
    code = "def f(x):\n    return x + 1;\n```"
    assert resolve_domain("Legal", "tool", code) == "legal"
    assert resolve_domain(None, " RAG ", code) == "rag"
    assert resolve_domain(None, None, code) == "code"


def test_hints_are_an_open_set():
    assert resolve_domain(None, "react", "hello") == "react"
    assert resolve_domain(None, "sql-agent", "hello") == "sql-agent"


@pytest.mark.parametrize(
    "args, name",
    [
        (("", None, "x"), "domain must not be empty"),
        (("  ", None, "x"), "domain must not be empty or blank, got '  '"),
        ((None, "  ", "x"), "hint"),
        ((3, None, "x"), "domain"),
        ((None, ["tool"], "x"), "hint"),
        ((None, None, [{"role": "user", "content": "hi"}]), "prompt_text"),
        ((None, None, None), "prompt_text"),
    ],
)
def test_bad_input_names_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        resolve_domain(*args)


# Long prompts that reach the end of the classifier: code-like text, and prose with numbers,
# curly quotes and no document markers (every feature runs on it, then it falls to chat).
LONG_PROMPTS = {
    "code-like": "Context:\n" + ("Revenue grew 4% while costs def f(): return x; fell => margins rose. " * 4000)
                 + "\nQuestion: what happened to margins?",
    "prose": ("On 12 March the board’s 7 members met for 3 hours and agreed that the “new plan” should "
              "cut costs by 15 percent before 2026, while the 4 regional offices keep their staff. " * 3000),
}


@pytest.mark.parametrize("name", list(LONG_PROMPTS))
def test_classifier_is_well_under_a_millisecond_on_a_long_prompt(name):
    """It reads the prompt's head and tail only: a fraction of a millisecond (0.06-0.2 ms on a
    2-core machine) whatever the length, where reading all of 250 kB takes several. The bound is
    2 ms, for a median of 31 on a machine busy with other tests."""
    long_prompt = LONG_PROMPTS[name]
    assert len(long_prompt) > 250_000
    classify_prompt(long_prompt)  # warm caches
    times = []
    for _ in range(31):
        t0 = time.perf_counter()
        classify_prompt(long_prompt)
        times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 2e-3


@needs_sharegpt
def test_accuracy_on_the_held_out_labelled_set():
    """At least 90% right without hints on prompts the classifier was not tuned on, and no label
    left behind (each recalled at least 75%), so a gain on chat cannot hide losing math."""
    from flashspec_workloads.labelled import LABELS, labelled_prompts

    items = labelled_prompts("heldout")
    assert len(items) >= 250 and {i.label for i in items} == set(LABELS)
    right = [classify_prompt(i.text) == i.label for i in items]
    assert sum(right) / len(items) >= 0.9
    for label in LABELS:
        hits = [r for r, i in zip(right, items) if i.label == label]
        assert sum(hits) / len(hits) >= 0.75, label
