"""A callback handler the LangChain examples share: one line per model call with its router domain
and the draft that served it, read from the FlashSpec stats on each response."""
from __future__ import annotations

from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult


class StepPrinter(BaseCallbackHandler):
    """Prints, and keeps in `steps`, the domain, its source and the draft of every model call."""

    def __init__(self, quiet: bool = False) -> None:
        self.steps: list[dict[str, Any]] = []
        self.quiet = quiet

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        gen = response.generations[0][0]
        message = getattr(gen, "message", None)
        info = (message.response_metadata if message is not None else gen.generation_info or {}).get("flashspec", {})
        arms = info.get("arms", [])
        step = {
            "domain": info.get("domain"),
            "source": info.get("domain_source"),
            "node": info.get("agent_node"),
            "draft": info.get("draft"),
            "arms": sorted(set(arms)),
            "accepted": info.get("accepted"),
            "drafted": info.get("drafted"),
            "tool_calls": [c["name"] for c in getattr(message, "tool_calls", None) or []],
            "tool_args": [c["args"] for c in getattr(message, "tool_calls", None) or []],
            "text": gen.text,
        }
        self.steps.append(step)
        if not self.quiet:
            where = f" node={step['node']}" if step["node"] else ""
            calls = f" -> calls {step['tool_calls']}" if step["tool_calls"] else ""
            print(
                f"  [model call {len(self.steps)}]{where} domain={step['domain']} (from {step['source']}) "
                f"draft={step['draft']} accepted {step['accepted']}/{step['drafted']} drafted tokens{calls}"
            )
