"""Retrieval with FlashSpecLLM: the offline embedding ranks, query engines file synthesis as rag."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from fakes import tiny_engine
from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex

from flashspec_integrations.hashing import hashed_vector
from flashspec_integrations.llama_index import FlashSpecLLM, HashingEmbedding, record_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DOCS = EXAMPLES / "docs"
QUESTIONS = {
    "How long is the Tessel River?": "tessel_river.md",
    "When does the bakery on Mill Street open?": "copper_kettle.md",
    "How do I reset my vacuum robot?": "orbit_robot.md",
    "Who founded the lantern festival in Kelvara?": "harbor_lights.md",
}


@pytest.fixture
def settings():
    """Settings are process-global: put back whatever a test changed."""
    saved = (Settings._llm, Settings._embed_model)
    try:
        yield Settings
    finally:
        Settings._llm, Settings._embed_model = saved


@pytest.fixture(scope="module")
def documents():
    return SimpleDirectoryReader(str(DOCS)).load_data()


def test_hashing_embedding_ranks_the_right_document_first(documents):
    embed = HashingEmbedding()
    names = [d.metadata["file_name"] for d in documents]
    doc_vecs = embed.get_text_embedding_batch([d.text for d in documents])
    for question, expected in QUESTIONS.items():
        q = embed.get_query_embedding(question)
        scores = [sum(a * b for a, b in zip(q, v)) for v in doc_vecs]
        assert names[scores.index(max(scores))] == expected, (question, dict(zip(names, scores)))


def test_hashing_vectors_are_unit_length_even_for_text_without_words():
    vec = hashed_vector("The Tessel River is long", 64)
    assert abs(sum(v * v for v in vec) - 1.0) < 1e-9
    assert hashed_vector("the of and", 64) == [0.125] * 64  # uniform: 1 / sqrt(64)
    assert hashed_vector("rivers", 64) == hashed_vector("river", 64)


def test_query_engine_on_settings_llm_retrieves_and_files_synthesis_as_rag(settings, documents, torch_one_thread):
    settings.llm = FlashSpecLLM(engine=tiny_engine(), max_tokens=8)
    settings.embed_model = HashingEmbedding()
    index = VectorStoreIndex.from_documents(documents)
    with record_steps() as recorder:
        response = index.as_query_engine(similarity_top_k=1).query("How long is the Tessel River?")
        streamed = index.as_query_engine(similarity_top_k=1, streaming=True).query("How long is the Tessel River?")
        streamed_text = "".join(streamed.response_gen)
        asynced = asyncio.run(index.as_query_engine(similarity_top_k=1).aquery("How long is the Tessel River?"))
    assert response.source_nodes[0].metadata["file_name"] == "tessel_river.md"
    assert [s.domain for s in recorder.steps] == ["rag", "rag", "rag"]
    assert [s.hint for s in recorder.steps] == ["rag", "rag", "rag"]
    # Greedy: the same synthesis three ways (the random model's text may be blank, hence the steps).
    texts = [s.text for s in recorder.steps]
    assert texts[0] == texts[1] == texts[2] == streamed_text
    assert str(response) == str(asynced)
    assert all(s.completion_tokens > 0 and s.arms for s in recorder.steps)


@pytest.mark.slow
def test_rag_query_engine_example_on_the_default_model(settings, capsys, default_engine):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import llama_index_rag_query_engine as example
    finally:
        sys.path.remove(str(EXAMPLES))
    response = example.main(["--max-tokens", "16"])
    out = capsys.readouterr().out
    assert isinstance(settings.llm, FlashSpecLLM) and settings.llm.get_engine() is default_engine
    assert response.source_nodes[0].metadata["file_name"] == "tessel_river.md"
    assert "step 1: [chat] domain=rag draft=" in out
    assert "source: tessel_river.md" in out
    assert "412" in str(response)  # the model answers from the retrieved document
