"""Retrieval-augmented prompts as the frameworks render them, over real passages.

Three renderings, so the classifier and the drafts meet more than one layout: LangChain's
`rlm/rag-prompt` (the hub prompt of LangChain's RAG tutorial), LlamaIndex's chat text-QA prompt
(`CHAT_TEXT_QA_PROMPT`: a system prompt and the `DEFAULT_TEXT_QA_PROMPT_TMPL` body, each node
with its metadata line) and a plain numbered-documents prompt. The templates are copied here
rather than imported so that the stream does not depend on which framework is installed.
"""
from __future__ import annotations

import random

from flashspec_workloads.passages import Passage, Question, ask, context_for

TEMPLATES = ("langchain", "llama_index", "numbered")

_LANGCHAIN = ("You are an assistant for question-answering tasks. Use the following pieces of "
              "retrieved context to answer the question. If you don't know the answer, just say "
              "that you don't know. Use three sentences maximum and keep the answer concise.\n"
              "Question: {question} \nContext: {context} \nAnswer:")
_LLAMA_INDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\nAlways answer the query using "
    "the provided context information, and not prior knowledge.\nSome rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n2. Avoid statements like "
    "'Based on the context, ...' or 'The context information ...' or anything along those lines.")
_LLAMA_INDEX = ("Context information is below.\n---------------------\n{context}\n"
                "---------------------\nGiven the context information and not prior knowledge, "
                "answer the query.\nQuery: {question}\nAnswer: ")
_NUMBERED_SYSTEM = ("Answer the question using only the documents provided. Quote the sentence "
                    "that supports your answer, then explain briefly.")


def render_context(chunks: list[Passage], template: str) -> str:
    """The retrieved chunks joined the way each framework joins them."""
    if template == "langchain":
        return "\n\n".join(c.text for c in chunks)
    if template == "llama_index":
        return "\n\n".join(f"file_path: uploads/{c.id.replace('#', '-')}.txt\n\n{c.text}" for c in chunks)
    return "\n\n".join(f"[{i}] {c.text}" for i, c in enumerate(chunks, 1))


def rag_messages(context: str, question: str, template: str) -> list[dict[str, str]]:
    """The chat messages of one retrieval-synthesis request."""
    if template == "langchain":
        return [{"role": "user", "content": _LANGCHAIN.format(question=question, context=context)}]
    if template == "llama_index":
        return [{"role": "system", "content": _LLAMA_INDEX_SYSTEM},
                {"role": "user", "content": _LLAMA_INDEX.format(context=context, question=question)}]
    if template == "numbered":
        return [{"role": "system", "content": _NUMBERED_SYSTEM},
                {"role": "user", "content": f"Documents:\n{context}\n\nQuestion: {question}"}]
    raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")


def questions_over(first: Passage, pool: tuple[Passage, ...], n: int,
                   rng: random.Random) -> tuple[list[Passage], list[Question]]:
    """A retrieved context led by `first` and up to `n` distinct questions about its passages."""
    chunks = context_for(first, pool, rng)
    joined = "\n\n".join(c.text for c in chunks)
    questions: list[Question] = []
    for chunk in [c for c in chunks if c.id == first.id] + [c for c in chunks if c.id != first.id]:
        for _ in range(3):
            q = ask(chunk, joined, rng)
            if q and len(questions) < n and q.answer_quote not in {x.answer_quote for x in questions}:
                questions.append(q)
    return chunks, questions
