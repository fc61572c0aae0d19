"""HashingEmbedding: LlamaIndex's embedding interface over `flashspec_integrations.hashing` (offline)."""
from __future__ import annotations

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field

from flashspec_integrations.hashing import hashed_vector


class HashingEmbedding(BaseEmbedding):
    """Hashed bag-of-words embedding for offline retrieval (no model, no download)."""

    dim: int = Field(default=1024, ge=16, description="Number of hash buckets (vector length).")
    model_name: str = Field(default="flashspec-hashing-bow")

    @classmethod
    def class_name(cls) -> str:
        return "HashingEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return hashed_vector(query, self.dim)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return hashed_vector(query, self.dim)

    def _get_text_embedding(self, text: str) -> list[float]:
        return hashed_vector(text, self.dim)
