"""A LlamaIndex RAG query engine over a local folder of documents, decoded by FlashSpec (offline).

    python examples/llama_index_rag_query_engine.py "How long is the Tessel River?"
    python examples/llama_index_rag_query_engine.py --docs path/to/folder --max-tokens 128 "..."

`Settings.llm = FlashSpecLLM()` puts the embedded default model under the whole query engine; the
synthesis call is filed under the `rag` domain, where the router learns that copying from the
retrieved text (prompt lookup) pays. The embedding is a hashed bag of words, so nothing is
downloaded. For every LLM call the script prints the domain and the draft the router used.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex

from flashspec_integrations.llama_index import FlashSpecLLM, HashingEmbedding, record_steps

DOCS = Path(__file__).parent / "docs"
QUESTION = "How long is the Tessel River?"


def build_query_engine(docs_dir: Path, top_k: int = 1, streaming: bool = False):
    """Index every document in `docs_dir` with the offline embedding; answer with Settings.llm."""
    if not docs_dir.is_dir():
        raise ValueError(f"--docs: {str(docs_dir)!r} is not a folder of documents")
    Settings.embed_model = HashingEmbedding()
    documents = SimpleDirectoryReader(str(docs_dir)).load_data()
    index = VectorStoreIndex.from_documents(documents)
    return index.as_query_engine(similarity_top_k=top_k, streaming=streaming)


def main(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--docs", type=Path, default=DOCS, help="folder of documents to index")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=1, help="chunks retrieved per question")
    args = parser.parse_args(argv)

    Settings.llm = FlashSpecLLM(max_tokens=args.max_tokens)
    query_engine = build_query_engine(args.docs, args.top_k)
    with record_steps() as recorder:
        response = query_engine.query(args.question)
    for i, step in enumerate(recorder.steps, 1):
        print(f"step {i}: {step.describe()}")
    print(f"question: {args.question}")
    print(f"answer: {str(response).strip()}")
    for node in response.source_nodes:
        print(f"source: {node.metadata.get('file_name')} (score {node.score:.3f})")
    return response


if __name__ == "__main__":
    main()
