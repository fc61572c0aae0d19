"""Which domain a decode request belongs to, so the router keeps separate statistics per domain.

Order of precedence: an explicit `domain=` from the caller; then a hint from the framework
adapter (tools bound -> "tool", retrieval synthesis -> "rag", structured output -> "json", an open
set); then a cheap classifier over the prompt text. The classifier runs once per request, before
the first token, so it must cost far less than a decode step: it only looks at the head and the
tail of the prompt (where instructions, schemas, tool results and the question sit) plus the
prompt's length, and it uses a handful of precompiled regular expressions.

The classifier's labels: "tool" (tool/function-call JSON, ReAct action traces), "json"
(structured output requested), "code", "rag" (long context with retrieved documents), "math",
and "chat" (everything else). Misclassification only costs speed, never correctness: the
router's per-domain bandits learn whatever works for the prompts that land in each label.
"""
from __future__ import annotations

import re

CHAT, CODE, TOOL, JSON, RAG, MATH = "chat", "code", "tool", "json", "rag", "math"

# Characters inspected at each end of the prompt; the middle of a long prompt is usually the
# bulk of retrieved documents or a file, which the head and tail already characterise.
_HEAD = 2500
_TAIL = 2500
# A prompt longer than this with a document marker is treated as retrieval-augmented.
_LONG_CONTEXT_CHARS = 4000

# Speed: case-insensitive regex alternations cost ~50 ns per character each in `re`, so the
# classifier lower-cases once, splits into a word set once (C-speed `translate` + `split`), and
# then uses set intersections, substring tests (`in`, C-speed) and a few regexes that begin
# with a literal (which `re` can skip to). Each feature is one *kind* of evidence; a label needs
# several different kinds, so one stray "=>" or "solve" in prose does not flip a chat prompt.
_WORD_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")
_TO_SPACE = {i: " " for i in range(128) if chr(i) not in _WORD_CHARS}

_TOOL_STRONG = (
    "<tool_call>", "</tool_call>", "<|tool_call|>", "<tool_response>", "tool_calls",
    "function_call", "tool_call_id", "tool_choice", "<|start_header_id|>ipython",
    "<|start_header_id|>tool", "<|python_tag|>",
)
_TOOL_CALL_JSON = re.compile(
    r'"name"\s*:\s*"[^"\n]{1,80}"\s*,\s*"(?:arguments|parameters|args|input)"\s*:'
    r'|"type"\s*:\s*"function"'
)
_REACT_LINES = ("\naction:", "\naction input:", "\nobservation:", "\nthought:", "\nfinal answer:")
_TOOL_PHRASES = (
    "access to the following tools", "access to the following functions", "available tools",
    "available functions", "call a tool", "call one of the tools", "use a tool", "tool result",
)

_JSON_WORDS = {"schema", "object", "format", "formatted", "respond", "reply", "output", "return",
               "valid", "only", "keys", "fields", "parseable"}
_JSON_SCHEMA = re.compile(r'"\$schema"|"properties"\s*:\s*\{|"required"\s*:\s*\[')

_CODE_LINE_START = re.compile(
    r"\n[ \t]*(?:def |class \w|async def |import \w|from [\w.]+ import |#include|package \w"
    r"|using namespace|public class|fn \w|func \w|select .{1,80} from |for \w+ in |while .{1,60}:$"
    r"|print\()"
)
# Two or more assignment-looking lines ("n = 0", "total += x") read as code, not prose.
_ASSIGNMENT = re.compile(r"\n[ \t]*[a-z_][\w.\[\]'\"]{0,40} ?[-+*/|&]?= ?[^=\s]")
_CODE_KEYWORDS = {"def", "elif", "lambda", "const", "let", "var", "fn", "func", "void", "struct",
                  "impl", "printf", "println", "console", "return", "self", "null", "nullptr",
                  "async", "await", "namespace", "typedef", "pub", "int", "bool", "str", "args",
                  "kwargs", "init", "main", "true", "false", "none"}
_CODE_OPERATORS = ("=>", "->", "::", "!==", "===", "&&", "||", "+=", "++", "!=", "==", "</")
# Names that almost only ever mean programming; "python", "java", "rust", "swift", "ruby",
# "react" and "go" also mean other things, so they count as weaker evidence.
_CODE_NAMES_STRONG = {"javascript", "typescript", "golang", "sql", "mysql", "postgresql", "sqlite",
                      "html", "css", "kotlin", "haskell", "php", "numpy", "pandas", "pytorch",
                      "django", "flask", "csharp", "powershell", "dockerfile", "regex", "nodejs",
                      "jquery", "matplotlib", "tensorflow", "vba", "perl", "scala", "fortran"}
_CODE_NAMES_WEAK = {"python", "java", "rust", "swift", "ruby", "react", "bash", "yaml",
                    "cpp", "android", "docker", "git", "github", "npm", "linux", "api", "sdk"}
_CODE_TASKS = {"function", "method", "class", "script", "program", "bug", "compile", "refactor",
               "debug", "implement", "snippet", "code", "variable", "loop", "recursion", "api",
               "query", "syntax", "compiler", "crashes", "segfault", "stacktrace", "iterator",
               "app", "crud", "microservice", "microservices", "endpoint", "database", "deploy",
               "implementation", "object", "library", "framework", "install", "field"}
_TRACEBACK = ("traceback (most recent call last)", "error: ", "exception: ", "segmentation fault",
              "stack trace", "undefined reference")

_RAG_LINE = re.compile(
    r"\n[ \t]*(?:context|contexts|context information|documents?|sources?|passages?|excerpts?"
    r"|search results|retrieved \w+|references?)[ \t]*[:\-#]"
    r"|\n[ \t]*(?:\[\d+\]|\(\d+\)|document \d+|doc \d+|source \d+|passage \d+|chunk \d+)"
)
_RAG_PHRASES = (
    "context above", "above context", "following context", "provided context", "given context",
    "the context", "documents above", "provided documents", "following documents",
    "retrieved documents", "provided passages", "following passages", "passages above",
    "sources above", "provided sources", "cite ", "citation", "file_path:", "page_label:",
    "according to the document", "based on the document", "using only the",
)

_MATH_SYMBOLS = ("\\frac", "\\sqrt", "\\int", "\\sum", "\\cdot", "\\times", "\\leq",
                 "\\geq", "\\pi", "\\alpha", "\\theta", "^2", "^3", "×", "÷", "√", "∫", "≤", "≥")
_MATH_WORDS = {"solve", "simplify", "evaluate", "integrate", "differentiate", "derivative",
               "integral", "equation", "equations", "theorem", "prove", "proof", "lemma",
               "probability", "compute", "calculate", "sum", "product", "remainder", "divisible",
               "prime", "primes", "integer", "integers", "irrational", "rational", "polynomial",
               "factor", "factorial", "matrix", "vector", "angle", "triangle", "area", "modulo",
               "percent", "fraction", "digits", "inequality", "logarithm", "sqrt"}
_ARITHMETIC = re.compile(r"\d\s*[-+*/^=<>]\s*\(?-?\d|\d[a-z]\s*[-+=]|\b[a-z]\s*=\s*-?\d")


def _code_kinds(low: str, words: set[str]) -> int:
    kinds = 0
    kinds += 2 * ("```" in low)  # a fenced block is rarely anything but code
    kinds += _CODE_LINE_START.search(low) is not None
    kinds += len(words & _CODE_KEYWORDS) >= 2
    kinds += sum(op in low for op in _CODE_OPERATORS) >= 2
    kinds += (low.count(";\n") + low.count("{\n") + low.count("}\n") + low.count("):\n")) >= 2
    kinds += (low.count("\n    ") + low.count("\n\t")) >= 2  # indented block
    kinds += len(_ASSIGNMENT.findall(low, 0, 4000)) >= 2
    if words & _CODE_NAMES_STRONG or "c++" in low:
        kinds += 3
    language = bool(words & _CODE_NAMES_WEAK)
    task = bool(words & _CODE_TASKS)
    # A language named next to a programming task ("implement a Rust function") is a code
    # request even when it contains no code yet, so the pair counts as a third kind.
    kinds += language + task + (language and task)
    kinds += any(t in low for t in _TRACEBACK)
    return kinds


def _math_kinds(low: str, words: set[str]) -> int:
    hits = len(words & _MATH_WORDS) + ("how many" in low or "how much" in low)
    kinds = min(hits, 2)
    kinds += any(sym in low for sym in _MATH_SYMBOLS)
    kinds += _ARITHMETIC.search(low) is not None
    return kinds


def classify_prompt(prompt_text: str) -> str:
    """Best-guess domain label for a prompt: tool, json, code, rag, math or chat."""
    if not isinstance(prompt_text, str):
        raise ValueError(
            "prompt_text must be a str (render chat messages to text first), "
            f"got {type(prompt_text).__name__}"
        )
    n = len(prompt_text)
    text = prompt_text if n <= _HEAD + _TAIL else prompt_text[:_HEAD] + "\n" + prompt_text[-_TAIL:]
    low = "\n" + text.lower()  # the leading newline lets line-start patterns match line one
    words = set(low.translate(_TO_SPACE).split())

    if any(m in low for m in _TOOL_STRONG) or _TOOL_CALL_JSON.search(low):
        return TOOL
    react = sum(line in low for line in _REACT_LINES)
    if react >= 2 or (react == 1 and any(p in low for p in _TOOL_PHRASES)):
        return TOOL

    rag_kinds = (_RAG_LINE.search(low) is not None) + any(p in low for p in _RAG_PHRASES)
    if rag_kinds and n >= _LONG_CONTEXT_CHARS:
        return RAG

    if rag_kinds >= 2:  # a short prompt that both holds documents and asks about them
        return RAG
    code = _code_kinds(low, words)
    json_requested = "json" in words and bool(words & _JSON_WORDS)
    if _JSON_SCHEMA.search(low) or (json_requested and code < 4):
        return JSON
    if code >= 3 or "traceback (most recent call last)" in low:
        return CODE
    if _math_kinds(low, words) >= 2:
        return MATH
    return CHAT


def _clean(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str or None, got {type(value).__name__}")
    cleaned = value.strip().lower()
    if not cleaned:
        raise ValueError(f"{name} must not be empty or blank, got {value!r}; pass None to let the next source decide")
    return cleaned


def resolve_domain(explicit: str | None, hint: str | None, prompt_text: str) -> str:
    """The domain label for a request: `explicit`, else the adapter's `hint`, else the classifier.

    Labels are lower-cased and stripped so that "Tool" and "tool " share statistics. Any label
    is accepted (the set is open); unknown ones simply get their own bandit.
    """
    explicit_label = _clean(explicit, "domain")  # the caller's `domain=` argument
    if explicit_label is not None:
        return explicit_label
    hint_label = _clean(hint, "hint")
    if hint_label is not None:
        return hint_label
    return classify_prompt(prompt_text)
