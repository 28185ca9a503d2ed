"""The output text as it grows: streamed pieces without partial characters, and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class TextTracker:
    """Decodes the output as it grows: streams new text, holds back partial characters, finds stop strings."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.on_text = on_text
        self.sent = ""
        self.searched = 0  # text length already searched for stop strings

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of `ids` without special tokens."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def stop_at(self, out: list[int], before: int) -> int | None:
        """Return the length of `out` that just completes a stop string (None: no stop string yet)."""
        if not self.stop:
            return None
        text = self.decode(out)
        start = max(0, self.searched - max(len(s) for s in self.stop) + 1)
        self.searched = len(text)
        if not any(s in text[start:] for s in self.stop):
            return None
        for end in range(before + 1, len(out) + 1):  # the first token that completes a stop string
            if any(s in self.decode(out[:end]) for s in self.stop):
                return end
        return len(out)

    def push(self, out: Sequence[int], *, final: bool = False) -> None:
        """Stream the text added since the last call (all of it when `final`)."""
        if self.on_text is None:
            return
        text = self.decode(out)
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character may still change
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.on_text(text[len(self.sent) :])
            self.sent = text
