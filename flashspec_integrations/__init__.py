"""Thin adapters that put the FlashSpec engine under agent frameworks.

Each framework's adapter lives in its own module and is imported on demand, so this package
imports neither LangChain nor LlamaIndex:

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
    from flashspec_integrations.llama_index import FlashSpecLLM

`flashspec_integrations.context` (framework run context -> router domain) is shared by both.
"""
