"""Word corpora whose better suffix rule is known, for `--suffix-rule auto`'s tests (in process and on Spark).

Repeated phrases make long n-grams right, so the longest stored suffix drafts best; Zipf noise words alone make
rare long n-grams' thin trees lose to `expected`'s rich ones. Token id t is the word `CHOICE_WORDS[t - 2]` of a
word tokenizer over `CHOICE_WORDS` (ids 0 and 1 are its unknown and end tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from crest_client.codec import encode_tree

from crest.config import IngestOptions
from tests.fix_corpus import write_jsonl

CHOICE_WORDS = [f"w{i}" for i in range(40)]


def word_offsets(lengths: list[int]) -> np.ndarray:
    """Return document offsets ([D + 1] int64) for documents of these lengths."""
    return np.r_[0, np.cumsum(lengths)].astype(np.int64)


def word_phrases(rng: np.random.Generator) -> list[list[int]]:
    """Return 8 phrases of 2-5 token ids."""
    return [rng.integers(2, 14, size=int(rng.integers(2, 6))).tolist() for _ in range(8)]


def word_corpus(
    rng: np.random.Generator, phrases: list[list[int]], phrases_share: float, documents: int
) -> tuple[np.ndarray, np.ndarray]:
    """Documents of 60 words or so: the phrases (each a few words) with `phrases_share`, else Zipf noise words."""
    docs = []
    for _ in range(documents):
        words: list[int] = []
        while len(words) < 60:
            words += (
                phrases[int(rng.integers(8))] if rng.random() < phrases_share else [2 + min(30, int(rng.zipf(1.4)))]
            )
        docs.append(words)
    return np.concatenate([np.array(d, dtype=np.int32) for d in docs]), word_offsets([len(d) for d in docs])


def write_words(path: Path, tokens: np.ndarray, offsets: np.ndarray) -> Path:
    """Write the documents as a JSONL file of texts that the word tokenizer reads back as these token ids."""
    texts = [
        " ".join(CHOICE_WORDS[t - 2] for t in tokens[a:b].tolist()) for a, b in zip(offsets, offsets[1:], strict=False)
    ]
    return write_jsonl(path, [{"text": text} for text in texts])


def choice_options(seed: int, rule: str) -> IngestOptions:
    """Return the small build options these corpora are built with."""
    return IngestOptions(
        top_t=400, max_n=4, continuation_length=4, max_matches=20, tree_size=16, seed=seed, suffix_rule=rule
    )


def row_of(tokens: list[int], tree: int, count: int) -> tuple[bytes, int, int, bytes]:
    """Return a stored row (key, n, count, blob) of these 2-byte tokens whose tree is one node, `tree`."""
    key = np.array(tokens, dtype=">u2").tobytes()
    blob = encode_tree(np.array([tree]), np.array([-1], dtype=np.int32), np.array([count]), vocab_size=100)
    return key, len(tokens), count, blob
