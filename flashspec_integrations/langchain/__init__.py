"""LangChain models over the FlashSpec engine.

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
"""
from flashspec_integrations.langchain.chat_models import ChatFlashSpec
from flashspec_integrations.langchain.llms import FlashSpecLLM

__all__ = ["ChatFlashSpec", "FlashSpecLLM"]
