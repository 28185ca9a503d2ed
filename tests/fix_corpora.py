"""Hypothesis strategies and helpers for small token corpora split into documents."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def corpora(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Draw (documents, vocab size): a few short documents over a small vocabulary, empty ones included."""
    vocab = draw(st.integers(1, 6))
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=25), min_size=1, max_size=6))
    return docs, vocab


def flatten(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Return the flat int32 token array and int64 document offsets of `docs`."""
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return tokens, offsets
