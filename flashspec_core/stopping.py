"""Per-row output text: EOS, max_new_tokens and stop strings spanning several tokens.

Text is decoded from all output tokens each step (outputs are short next to the model's cost, and
incremental decoding of byte-level BPE is where bugs hide). Stop strings cut the text exactly
before their first occurrence; streamed text holds back any tail that could still grow into a stop
string, and any incomplete UTF-8 character.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase


@dataclass
class RowOutput:
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    streamed: int = 0  # characters of `text` already handed out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string

    def append(self, new_tokens: Sequence[int]) -> list[int]:
        """Add a step's verified tokens; return the ones kept (cut at EOS, length or a stop string)."""
        kept: list[int] = []
        for tok in new_tokens:
            kept.append(tok)
            if tok in self.eos_ids:
                self.finish_reason = "stop"
                break
            if len(self.token_ids) + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        start = len(self.token_ids)
        self.token_ids.extend(kept)
        self.text = self._decode(self.token_ids)
        if self.stop:
            self._apply_stop(start)
        return self.token_ids[start:]

    def _apply_stop(self, step_start: int) -> None:
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep tokens up to the one that completed the earliest stop string.
        for k in range(step_start + 1, len(self.token_ids) + 1):
            partial = self._decode(self.token_ids[:k])
            if any(partial.find(s) == cut for s in self.stop):
                del self.token_ids[k:]
                break
        self.text = self.text[:cut]
        self.finish_reason = "stop"

    def take_delta(self) -> str:
        """The next piece of text that can be streamed without ever being taken back."""
        safe = len(self.text)
        if not self.finished:
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if self.text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            safe -= hold
            while safe > 0 and self.text[safe - 1] == "\ufffd":
                safe -= 1
        safe = max(safe, self.streamed)
        delta = self.text[self.streamed:safe]
        self.streamed = safe
        return delta
