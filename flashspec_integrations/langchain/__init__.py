"""LangChain models over the FlashSpec engine (one module per public class, as langchain-ollama).

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM, HashingEmbeddings
"""
from flashspec_integrations.langchain.chat_models import ChatFlashSpec
from flashspec_integrations.langchain.embeddings import HashingEmbeddings
from flashspec_integrations.langchain.llms import FlashSpecLLM

__all__ = ["ChatFlashSpec", "FlashSpecLLM", "HashingEmbeddings"]
