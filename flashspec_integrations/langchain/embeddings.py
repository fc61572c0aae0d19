"""HashingEmbeddings: LangChain's embedding interface over `flashspec_integrations.hashing` (offline)."""
from __future__ import annotations

from langchain_core.embeddings import Embeddings

from flashspec_integrations.hashing import hashed_vector


class HashingEmbeddings(Embeddings):
    """Hashed bag-of-words embeddings for offline retrieval (no model, no download)."""

    def __init__(self, dim: int = 1024) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 16:
            raise ValueError(f"dim must be an int of at least 16; got {dim!r}")
        self.dim = dim

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [hashed_vector(t, self.dim) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return hashed_vector(text, self.dim)
