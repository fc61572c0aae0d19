"""LlamaIndex LLM and embedding over the FlashSpec engine.

    from flashspec_integrations.llama_index import FlashSpecLLM
"""
from flashspec_integrations.llama_index.embeddings import HashingEmbedding
from flashspec_integrations.llama_index.llms import FlashSpecLLM
from flashspec_integrations.llama_index.steps import LLMStep, record_steps

__all__ = ["FlashSpecLLM", "HashingEmbedding", "LLMStep", "record_steps"]
