"""Which domain a decode request belongs to, so the router keeps separate statistics per domain.

Order of precedence: an explicit `domain=` from the caller; then a hint from the framework
adapter (tools bound -> "tool", retrieval synthesis -> "rag", structured output -> "json", an open
set); then a cheap classifier over the head and tail of the prompt text, run once per request
before the first token: "tool" (tool-call JSON, ReAct traces), "json" (structured output asked
for), "code", "rag" (long context with retrieved documents), "math" or "chat". A wrong label only
costs speed, never correctness: each label's bandit learns what works for the prompts it gets.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable

CHAT, CODE, TOOL, JSON, RAG, MATH = "chat", "code", "tool", "json", "rag", "math"

# Characters inspected at each end of the prompt; the middle of a long prompt is usually the
# bulk of retrieved documents or a file, which the head and tail already characterise (1,000 a
# side classify the labelled set of benchmarks/domain_accuracy.py as well as 2,500 did).
_HEAD = 1000
_TAIL = 1000
# A prompt longer than this with a document marker is treated as retrieval-augmented.
_LONG_CONTEXT_CHARS = 4000

# Speed: each case-insensitive regex alternation costs a pass over the text in `re`, so the
# classifier lower-cases once, splits into a word set once (C-speed `translate` + `split`), and
# then uses set intersections, substring tests (`in`, C-speed) and a few regexes that begin
# with a literal (which `re` can skip to). Each feature is one *kind* of evidence, weighted by how
# sure it is; a label needs a score from several, so one stray "=>" or "solve" in prose does not
# flip a chat prompt. The weights and word lists were tuned on the 'tune' half of the labelled set
# in flashspec_workloads (benchmarks/domain_accuracy.py) and are checked on the held-out half.
_WORD_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")
# A byte table: str.translate falls to a slow path on non-ASCII text (curly quotes are common),
# bytes.translate never does. Non-ASCII bytes become spaces too.
_TO_SPACE = bytes(c if chr(c) in _WORD_CHARS else 32 for c in range(256))


def _words(low: str) -> set[str]:
    """The lower-cased text's ASCII words (letters, digits, underscores) as a set."""
    return set(low.encode().translate(_TO_SPACE).decode("ascii").split())

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

# Asking for the answer itself as JSON ("in JSON", "as a JSON object", "JSON format"), as opposed
# to asking about JSON in code ("parse this JSON", "a JSON file").
_JSON_REQUEST = re.compile(
    r"\b(?:in|as|into) (?:a |an |the |valid |one )?json\b(?! (?:file|column|field|payload|body|data\b))"
    r"|\bform of (?:a )?json|\bjson(?:-ld)? (?:format|object|instance|representation|output|response|array)"
    r"|\b(?:return|output|respond with|reply with|give me) (?:only )?(?:a |an |the |valid )?json\b")
# Requests that leave no doubt (the output parsers' instructions, "answer in JSON"): they win
# over code evidence, since the question they wrap may well be about code.
_JSON_REQUEST_STRONG = re.compile(
    r"\b(?:answer|respond|reply|output|return)(?: only)?(?: in| with| as)? (?:a |an |valid )?json\b"
    r"|formatted as a json instance|json schema to follow|output a valid json|return a json object"
    r"|form of (?:a )?json|\bin json(?: format)?[.!?]?\s*$")
_JSON_SCHEMA = re.compile(r'"\$schema"|"properties"\s*:\s*\{|"required"\s*:\s*\[')

_CODE_LINE_START = re.compile(
    r"\n[ \t]*(?:def |class \w|async def |import \w|from [\w.]+ import |#include|package \w"
    r"|using namespace|public class|fn \w|func \w|select .{1,80} from |for \w+ in |while .{1,60}:$"
    r"|print\(|\$\w+ ?=|<\?php|<div|<html|const \w|let \w|var \w|function \w)"
)
# Two or more assignment-looking lines ("n = 0", "total += x") read as code, not prose.
_ASSIGNMENT = re.compile(r"\n[ \t]*[a-z_][\w.\[\]'\"]{0,40} ?[-+*/|&]?= ?[^=\s]")
_CODE_KEYWORDS = {"def", "elif", "lambda", "const", "let", "var", "fn", "func", "void", "struct",
                  "impl", "printf", "println", "console", "return", "self", "null", "nullptr",
                  "async", "await", "namespace", "typedef", "pub", "int", "bool", "str", "args",
                  "kwargs", "init", "main", "true", "false", "none", "foreach", "endif", "elseif"}
_CODE_OPERATORS = ("=>", "->", "::", "!==", "===", "&&", "||", "+=", "++", "!=", "==", "</", "();",
                   "[]", "{}")
# Names that almost only ever mean programming (languages, frameworks, libraries, build and
# deployment tools, databases): one of them in a request makes it a code request. The weak ones
# also mean other things ("swift", "excel", "shell", "react") or name platforms that prose is
# written about too ("aws", "wordpress"), so they need a programming word beside them.
_CODE_NAMES_STRONG = {
    "json", "yaml", "xml", "javascript", "typescript", "js", "ts", "jsx", "tsx", "nodejs",
    "golang", "sql", "mysql", "postgresql", "postgres", "sqlite", "mongodb", "mongo", "redis",
    "jsonb", "html", "css", "scss", "kotlin", "haskell", "php", "perl", "scala", "fortran",
    "elixir", "lua", "matlab", "vba", "csharp", "cpp", "dotnet", "aspnet", "powershell", "bash",
    "zsh", "dockerfile", "regex", "regexp", "numpy", "pandas", "pytorch", "tensorflow", "keras",
    "sklearn", "matplotlib", "opencv", "cv2", "django", "flask", "fastapi", "drf", "laravel",
    "symfony", "rails", "springboot", "jquery", "vue", "vuejs", "angular", "svelte", "sveltekit",
    "nextjs", "nuxt", "reactjs", "redux", "webpack", "babel", "rollup", "vite", "npm", "yarn",
    "pip", "conda", "maven", "gradle", "nuget", "kubernetes", "k8s", "kubectl", "helm",
    "terraform", "ansible", "nginx", "docker", "jenkins", "buildspec", "cloudformation",
    "cloudwatch", "datadog", "grafana", "prometheus", "kafka", "rabbitmq", "graphql", "grpc",
    "websocket", "oauth", "jwt", "flutter", "xamarin", "unity3d", "arduino", "esp32", "verilog",
    "vhdl", "selenium", "puppeteer", "playwright", "jest", "pytest", "junit", "gherkin",
    "cucumber", "tampermonkey", "greasemonkey", "autohotkey", "coffeescript", "peewee",
    "sqlalchemy", "alamofire", "firebase", "supabase", "ffmpeg", "solidity", "wasm", "cuda",
    "opengl", "vscode", "xcode", "intellij", "jupyter", "colab", "github", "gitlab", "bitbucket",
    "localhost", "jvm", "llvm", "gcc", "clang", "python", "java", "kivy", "kivymd", "pyqt",
    "tkinter", "sqs", "dynamodb", "abap"}
_CODE_NAMES_WEAK = {
    "swift", "ruby", "rust", "react", "shell", "excel", "spring", "lambda", "api", "apis", "csv",
    "sap", "apex", "assembly", "macro", "spreadsheet", "repository", "repo", "terminal", "cli",
    "backend", "frontend", "android", "ios", "aws", "azure", "gcp", "wordpress", "shopify",
    "salesforce", "eclipse", "ros", "raspberry", "linux", "ubuntu", "debian", "centos", "unix",
    "vlookup", "firmware", "microcontroller", "s3", "ec2", "heroku", "vercel", "netlify",
    "stackoverflow", "leetcode", "hackerrank", "git", "orm", "sdk", "backbone", "handlebars",
    "cobol"}
_CODE_TASKS = {"function", "functions", "method", "methods", "class", "classes", "script", "scripts",
               "program", "programs", "programming", "bug", "bugs", "compile", "compiler", "refactor",
               "debug", "debugging", "implement", "implementation", "snippet", "code", "coding",
               "variable", "variables", "loop", "recursion", "query", "queries", "syntax", "segfault",
               "stacktrace", "iterator", "crud", "microservice", "microservices", "endpoint",
               "endpoints", "database", "deploy", "deployment", "library", "framework", "install",
               "command", "commands", "cmd", "array", "arrays", "string", "integer", "boolean",
               "module", "package", "hook", "hooks", "component", "components", "server", "app",
               "application", "algorithm", "formula", "table", "schema", "exception", "error",
               "errors", "runtime", "thread", "threads", "container", "cluster", "workflow", "plugin",
               "extension", "webpage", "website", "url", "http", "request", "response",
               "parse", "parser", "unit", "test", "tests", "template", "config",
               "configure", "configuration", "file", "files", "folder", "directory", "column"}
_CODE_TASK_STRONG = {"code", "script", "program", "snippet", "function", "debug", "refactor",
                     "compile", "programming", "coding", "implement", "query", "command", "syntax"}
_TRACEBACK = ("traceback (most recent call last)", "error: ", "exception: ", "segmentation fault",
              "stack trace", "undefined reference", "npm err!", "at line ")
_PROSE_TASKS = {"story", "poem", "essay", "article", "blog", "song", "lyrics", "tweet", "email",
                "letter", "speech", "novel", "screenplay", "podcast", "video", "youtube", "linkedin",
                "instagram", "marketing", "seo", "slogan", "summary", "summarize", "summarise",
                "pitch", "campaign", "brand", "recipe", "itinerary", "resume", "cover"}

_RAG_LINE = re.compile(
    r"\n[ \t]*(?:context|contexts|context information|documents?|sources?|passages?|excerpts?"
    r"|(?:web )?search results|retrieved \w+|references?)[ \t]*[:\-#]"
    r"|\n[ \t]*(?:\[\d+\]|\(\d+\)|document \d+|doc \d+|source \d+|passage \d+|chunk \d+)"
)
_RAG_PHRASES = (
    "context above", "above context", "following context", "provided context", "given context",
    "the context", "documents above", "provided documents", "following documents",
    "retrieved documents", "provided passages", "following passages", "passages above",
    "sources above", "provided sources", "cite ", "citation", "file_path:", "page_label:",
    "according to the document", "based on the document", "using only the", "search results",
)

_MATH_SYMBOLS = ("\\frac", "\\sqrt", "\\int", "\\sum", "\\cdot", "\\times", "\\leq",
                 "\\geq", "\\pi", "\\alpha", "\\theta", "^2", "^3", "×", "÷", "√", "∫", "≤", "≥",
                 "\\mathbb", "\\mathcal", "\\begin", "$$", "≠", "∑", "π", "²", "³")
# Words that all but name a math problem, and words that often come with one.
_MATH_WORDS_STRONG = {
    "integrate", "differentiate", "derivative", "derivatives", "integral", "integrals", "equation",
    "equations", "theorem", "lemma", "probability", "probabilities", "divisible", "prime", "primes",
    "irrational", "polynomial", "factorial", "matrix", "matrices", "triangle", "modulo",
    "inequality", "logarithm", "sqrt", "variance", "circumference", "asymptote", "binomial",
    "perimeter", "arithmetic", "algebra", "geometry", "calculus", "trigonometry", "eigenvalue",
    "eigenvalues", "determinant", "parabola", "hypotenuse", "quadratic", "exponent", "npv", "irr",
    "math", "maths", "mathematics", "mathematical"}
_MATH_WORDS = {"simplify", "prove", "proof", "remainder", "integer", "integers", "vector", "vectors",
               "fraction", "fractions", "median", "radius", "diameter", "intercept", "slope", "dice",
               "percentage", "percent", "average", "altogether", "reals", "infinity", "infinitely",
               "solve", "calculate", "compute", "sum", "total", "twice", "half", "area", "volume",
               "distribution", "expected", "sequence"}
# "how many ...", "what is the probability ...": a quantity asked for. Only searched when the
# word set says it may match (a regex that starts with a word boundary scans every position).
_QUANTITY_QUESTION = re.compile(
    r"how (?:many|much|long|far|old)\b|what(?:'s| is| are| was) the (?:value|probability|average|"
    r"total|sum|number|area|result|answer|chance)\b")
_QUANTITY_VERBS = {"calculate", "compute", "solve", "find", "determine", "evaluate", "simplify", "prove"}
_QUANTITY_NOUNS = {"many", "much", "long", "far", "old", "value", "probability", "average", "total",
                   "sum", "number", "area", "result", "answer", "chance"}
# Arithmetic, not dates or ranges ("2/22/2023", "5-8 players"): a minus or a slash counts only
# between short numbers with spaces around it. Every branch starts at its operator (a
# look-behind checks what precedes it), so `re` tests one character class per position.
_ARITHMETIC = re.compile(
    r"[+*×÷^=<>](?<=\d[+*×÷^=<>])\s*\(?-?\d|[+*×÷^=<>](?<=\d [+*×÷^=<>])\s*\(?-?\d"
    r"|[-/](?<=\d [-/])(?<!\d\d\d\d [-/]) \(?\d{1,3}(?!\d)"
    r"|[-+=](?<=\d[a-z][-+=])|[-+=](?<=\d[a-z] [-+=])"
    r"|=(?<=\W[a-z]=)\s*-?\d|=(?<=\W[a-z] =)\s*-?\d|\^(?<=[a-z]\^)\d|\$[^$\n]{1,80}\$")
_ARITHMETIC_HINTS = ("+", "*", "×", "÷", "^", "=", "<", ">", "$", " - ", " / ")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NUMBER_WORDS = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve", "twenty", "thirty", "fifty", "hundred", "thousand", "dozen",
                 "half", "twice", "third", "quarter"}


def _code_score(low: str, words: set[str]) -> int:
    """Kinds of code evidence: code in the text, or a programming name or task in the request."""
    score = 0
    score += 2 * ("```" in low)  # a fenced block is rarely anything but code
    score += 2 * (_CODE_LINE_START.search(low) is not None)
    score += len(words & _CODE_KEYWORDS) >= 2
    score += sum(op in low for op in _CODE_OPERATORS) >= 2
    score += (low.count(";\n") + low.count("{\n") + low.count("}\n") + low.count("):\n")) >= 2
    score += (low.count("\n    ") + low.count("\n\t")) >= 2  # indented block
    score += len(_ASSIGNMENT.findall(low, 0, 4000)) >= 2
    strong = bool(words & _CODE_NAMES_STRONG) or "c++" in low or "c#" in low or " .net" in low
    score += 3 * strong + min(len(words & _CODE_NAMES_WEAK), 2)
    tasks = words & _CODE_TASKS
    task_strong = bool(words & _CODE_TASK_STRONG)
    score += bool(tasks) + 2 * task_strong + (len(tasks) >= 3)
    score += 2 * any(t in low for t in _TRACEBACK)
    if words & _PROSE_TASKS and not strong and "```" not in low:
        score -= 2  # "a blog post about our API", "a video script": prose about software
    return score


def _math_score(low: str, words: set[str]) -> int:
    """Kinds of math evidence: math words, symbols, arithmetic, a quantity asked for, numbers."""
    numbers = sum(1 for _ in itertools.islice(_NUMBER.finditer(low), 4)) + len(words & _NUMBER_WORDS)
    score = 3 * bool(words & _MATH_WORDS_STRONG) + min(len(words & _MATH_WORDS), 2)
    if "\\" in low or "^" in low or "$$" in low or not low.isascii():
        score += 2 * any(sym in low for sym in _MATH_SYMBOLS)
    if any(op in low for op in _ARITHMETIC_HINTS):  # most prose has none: skip the scan
        score += 3 * (_ARITHMETIC.search(low) is not None)
    quantity = bool(words & _QUANTITY_VERBS) or (
        bool(words & _QUANTITY_NOUNS) and ("how" in words or "what" in words)
        and _QUANTITY_QUESTION.search(low) is not None)
    score += 2 * quantity + (numbers >= 2) + (numbers >= 4)
    score += 2 * (quantity and numbers >= 2)  # a word problem: numbers given, a number asked for
    score -= 3 * bool(words & _PROSE_TASKS)
    return score


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
    words = _words(low)

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

    code = _code_score(low, words)
    if _JSON_SCHEMA.search(low) or ("json" in words and (
            _JSON_REQUEST_STRONG.search(low)
            # "in JSON" wins unless the request is code without counting the word JSON itself
            or (_JSON_REQUEST.search(low) and _code_score(low, words - {"json"}) < 4))):
        return JSON
    math = _math_score(low, words)
    if code >= 3 and code >= math:
        return CODE
    if math >= 5:
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


def resolve_domain(explicit: str | None, hint: str | None, prompt_text: str | Callable[[], str]) -> str:
    """The domain label for a request: `explicit`, else the adapter's `hint`, else the classifier.

    prompt_text: the prompt's text, or a function returning it, called only when the classifier
    runs (a caller holding token ids need not decode a long prompt when a domain or hint decides).
    Labels are lower-cased and stripped so that "Tool" and "tool " share statistics. Any label
    is accepted (the set is open); unknown ones simply get their own bandit.
    """
    explicit_label = _clean(explicit, "domain")  # the caller's `domain=` argument
    if explicit_label is not None:
        return explicit_label
    hint_label = _clean(hint, "hint")
    if hint_label is not None:
        return hint_label
    return classify_prompt(prompt_text() if callable(prompt_text) else prompt_text)
