"""An LCEL RAG chain, fully offline: retriever over local documents -> prompt -> ChatFlashSpec.

    python examples/langchain_rag_chain.py [--max-tokens 48] [question ...]

The retriever ranks a small local document set with the package's offline hashing embedding
(`HashingEmbeddings`: words and word pairs hashed into 1024 signed buckets, sublinear tf, L2
normalised), so retrieval really depends on the question and nothing is downloaded. The prompt is
a retrieval-synthesis prompt, so each call reaches the router under the "rag" domain; a chat turn
without retrieval follows for contrast. Each model call prints its domain and the draft chosen.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from flashspec_integrations.langchain import HashingEmbeddings

try:
    from langchain_steps import StepPrinter
except ImportError:  # imported as examples.langchain_rag_chain
    from examples.langchain_steps import StepPrinter

DOCUMENTS = [
    ("kettle.md", "The Aurora kettle boils one litre of water in 3 minutes. Its base has a 2200 W heating element."),
    ("kettle-care.md", "Descale the Aurora kettle every 4 weeks with white vinegar; rinse it twice afterwards."),
    ("toaster.md", "The Brisk toaster has 6 browning levels and a bagel mode that heats one side only."),
    ("warranty.md", "All Aurora and Brisk appliances carry a 2 year warranty; keep the receipt to claim it."),
    ("returns.md", "Unused appliances can be returned within 30 days for a full refund at any store."),
    ("blender.md", "The Vortex blender crushes ice with a 900 W motor and has a 1.5 litre glass jar."),
    ("shipping.md", "Orders ship in 2 working days; delivery is free above 50 euros."),
]
QUESTIONS = ["How long does the Aurora kettle take to boil water?", "How often should I descale the kettle?"]
CHAT_TURN = "Say hello to a new customer in one short sentence."

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a support assistant. Answer the question based only on the following context.\n\n"
               "Context:\n{context}"),
    ("human", "Question: {question}"),
])


def build_retriever(k: int = 2):
    docs = [Document(page_content=text, metadata={"source": name}) for name, text in DOCUMENTS]
    return InMemoryVectorStore.from_documents(docs, HashingEmbeddings()).as_retriever(search_kwargs={"k": k})


def format_docs(docs: Sequence[Document]) -> str:
    return "\n".join(f"[{d.metadata['source']}] {d.page_content}" for d in docs)


def build_chain(llm: BaseChatModel, retriever):
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm | StrOutputParser()


def main(argv: Sequence[str] | None = None, llm: BaseChatModel | None = None) -> list[dict]:
    """Runs the chain on each question and one plain chat turn; returns the recorded steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("questions", nargs="*", default=QUESTIONS)
    args = parser.parse_args(argv)
    if llm is None:
        from flashspec_integrations.langchain import ChatFlashSpec

        llm = ChatFlashSpec(max_tokens=args.max_tokens)
    retriever = build_retriever()
    chain = build_chain(llm, retriever)
    printer = StepPrinter()
    for question in args.questions:
        sources = [d.metadata["source"] for d in retriever.invoke(question)]
        print(f"Q: {question}\n  retrieved: {sources}")
        answer = chain.invoke(question, config={"callbacks": [printer]})
        print(f"  A: {answer.strip()}")
    print(f"Chat turn: {CHAT_TURN}")
    reply = llm.invoke(CHAT_TURN, config={"callbacks": [printer]})
    print(f"  A: {str(reply.content).strip()}")
    return printer.steps


if __name__ == "__main__":
    main()
