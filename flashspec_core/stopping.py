"""Per-row output text: EOS, max_new_tokens and stop strings spanning several tokens.

A row's text is decoded when read: each step for a row with stop strings or a streaming reader,
else once, when it finishes. Where the tokenizer decodes by concatenation
(`decodes_by_concatenation`) only the tokens after the last whole character are decoded again, and
the text is the same string a full decode gives; other tokenizers decode everything each time.
Stop strings cut the text exactly before their first occurrence; streamed text holds back any tail
that could still grow into a stop string, and any incomplete UTF-8 character.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

# Text holding every pattern the clean-up of decoded text rewrites (" ." -> ".", " n't" -> "n't", ...)
CLEANUP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j ' k"


def decodes_by_concatenation(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) for every a whose decode holds no U+FFFD.

    True for byte-level BPE without clean-up (GPT-2, Llama 3, Qwen, SmolLM): each token stands
    for bytes, the text is the UTF-8 decoding of their concatenation, and UTF-8 decoding starts
    afresh after a whole character (a U+FFFD-free decode of a means a ends on one; a literal
    U+FFFD only makes the test stricter). Not for SentencePiece decoders (a sequence's first
    space is dropped), WordPiece's, or where decoding cleans up spaces. Whether it does is asked
    of the tokenizer itself (its flag alone does not say: some transformers versions skip the
    clean-up for BPE whatever the flag).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return False
    ids = tokenizer.encode(CLEANUP_PROBE, add_special_tokens=False)
    return cast(str, tokenizer.decode(ids)) == backend.decode(ids)


@dataclass
class RowOutput:
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    streamed: int = 0  # characters of `text` already handed out
    concatenates: bool = False  # decodes_by_concatenation(tokenizer), asked once by the engine
    _text: str = field(init=False, default="")  # the text of the first `_text_of` tokens
    _text_of: int = field(init=False, default=0)
    _settled: int = field(init=False, default=0)  # leading tokens whose text is final
    _settled_text: str = field(init=False, default="")  # their text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The row's text so far: decoded when read (each step only for a row with stop strings or
        a streaming reader; else once, when it finishes), cut before a stop string."""
        if self._text_of != len(self.token_ids):
            self._text, self._text_of = self._text_now(), len(self.token_ids)
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string

    def _text_now(self) -> str:
        """decode(token_ids): where the tokenizer decodes by concatenation, the settled text plus
        the decode of what follows it, which settles in turn once it ends on a whole character."""
        if not self.concatenates:
            return self._decode(self.token_ids)
        tail = self._decode(self.token_ids[self._settled:])
        text = self._settled_text + tail
        if "\ufffd" not in tail:
            self._settled, self._settled_text = len(self.token_ids), text
        return text

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
        if self.stop:
            self._apply_stop(start)
        return self.token_ids[start:]

    def _apply_stop(self, step_start: int) -> None:
        text = self.text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep tokens up to the one that completed the earliest stop string.
        for k in range(step_start + 1, len(self.token_ids) + 1):
            partial = self._decode(self.token_ids[:k])
            if any(partial.find(s) == cut for s in self.stop):
                del self.token_ids[k:]
                self._settled, self._settled_text = 0, ""  # the text is cut below: nothing stays settled
                break
        self._text, self._text_of = text[:cut], len(self.token_ids)  # final: the row has finished
        self.finish_reason = "stop"

    def take_delta(self) -> str:
        """The next piece of text that can be streamed without ever being taken back."""
        text = self.text
        safe = len(text)
        if not self.finished:
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            safe -= hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
        safe = max(safe, self.streamed)
        delta = text[self.streamed:safe]
        self.streamed = safe
        return delta
