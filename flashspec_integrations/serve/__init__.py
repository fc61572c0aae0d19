"""An OpenAI-compatible HTTP endpoint for the FlashSpec engine, on Ray Serve.

    flashspec-agents serve --replicas 2          # http://127.0.0.1:8000/v1/chat/completions

Point `openai.OpenAI(base_url=...)`, LangChain's `ChatOpenAI(base_url=...)` or LlamaIndex's
`OpenAILike(api_base=...)` at it. One module per concern, and only `deployment` and `command` import
Ray: `protocol` (the wire format), `translate` (a request -> one engine call -> the reply), `stats`
(router statistics shared by the replicas), `guards`, `limits`, `planning`, `turns`, `admission`,
`errors` and `health` (what keeps an exposed server safe), `deployment` (the app), `command` (CLI).
"""
