"""An OpenAI-compatible HTTP endpoint for the FlashSpec engine, on Ray Serve.

    flashspec-agents serve --replicas 2          # http://127.0.0.1:8000/v1/chat/completions

Point `openai.OpenAI(base_url=...)`, LangChain's `ChatOpenAI(base_url=...)` or LlamaIndex's
`OpenAILike(api_base=...)` at it. One module per concern, and only `deployment` and `command`
import Ray:

- `protocol`: the OpenAI request and response models (pydantic) and OpenAI-style errors;
- `translate`: a request -> one engine call (prompt, tools, schema, domain), and the engine's
  output -> the reply (content, tool calls, stream deltas);
- `stats`: router statistics shared by every replica through one SQLite ledger;
- `guards`: the API key and the body size (ASGI middlewares); `limits`: what one request may ask,
  checked before any heavy work (and the CLI's flags); `planning`: planning off the event loop
  with a time limit; `admission`: the in-flight limit (429) and deadlines; `errors`: OpenAI's
  error shape, 500s with a request id only; `health`: the health check;
- `deployment`: the Ray Serve deployment (FastAPI ingress) and `build_app` for config files;
- `command`: the `flashspec-agents serve` entry.
"""
