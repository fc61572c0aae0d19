"""Adapters that put the FlashSpec engine under agent frameworks.

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
    from flashspec_integrations.llama_index import FlashSpecLLM

One subpackage per framework (`langchain/`, `llama_index/`: one module per public class), each
imported on demand, so this package imports neither framework. What both share (settings, engines,
domain rules, call planning, tool prompts and parsing, the async bridge) sits beside them; the
table in docs/adapters.md says which module holds what. `serve/` is the OpenAI-compatible server.
"""
