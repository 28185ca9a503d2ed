"""The REST baseline: an in-memory suffix array over a tokenized corpus, and its drafter.

As in REST (Algorithms 1-2), documents are concatenated into one int32 token array whose suffixes are
sorted; drafting looks for the longest context suffix from 16 tokens down to 2, takes up to 5000 of its
occurrences, their continuations of 10 tokens, and keeps the 64 heaviest nodes of the trie of these
continuations. Matching never needs more than the first 16 tokens of a suffix, so suffixes are sorted by
their first `max_suffix + 1` tokens only (the extra token groups occurrences with nothing after them first),
with numpy sorts on packed integer keys: a few tokens packed per key, then prefix doubling with overlapping
spans (3 -> 6 -> 12 -> 17 tokens: four sorts), ties kept in position order. Departures from REST, both in
its favour or neutral: no suffix key, match or continuation crosses a document end; occurrences with no
token after them in their document are not matches; when a suffix has more than `max_matches` occurrences
the drafter takes them evenly spaced over its sorted range (a stratified sample in which each continuation
keeps its share) rather than REST's first ones, which favour small token ids (`spread=False` restores that).
`nbytes` is the size REST keeps: the int32 token array plus the int32 suffix array (int64 past 2**31 tokens);
the document offsets and the first-token bucket table beside them are small.

"""

from __future__ import annotations

import bisect
import json
import shutil
import tempfile
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from crest_client.draft import Draft

from crest.config import resolve_model_spec
from crest.drafters.parts import Part, register_part
from crest.drafters.trie import build_draft
from crest.errors import ConfigError, CorpusError

FORMAT = 1


_FILES = ("tokens.npy", "sa.npy", "doc_offsets.npy", "heads.npy", "meta.json")


def _remaining(doc_offsets: np.ndarray, size: int, cap: int) -> np.ndarray:
    """Return each position's count of tokens left in its document (itself included), capped at `cap`."""
    rem = np.full(size, cap, dtype=np.uint8)  # [N]
    ends = doc_offsets[1:]
    lengths = np.diff(doc_offsets)
    for left in range(cap - 1, 0, -1):
        rem[ends[lengths >= left] - left] = left
    return rem


def _dense_rank(keys: np.ndarray) -> np.ndarray:
    """Return 1-based dense ranks of `keys` (0 stays free for "past the document end")."""
    order = np.argsort(keys)
    ordered = keys[order]
    new = np.empty(keys.shape[0], dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    del ordered
    rank = np.empty(keys.shape[0], dtype=np.int64)
    rank[order] = np.cumsum(new, dtype=np.int64)
    return rank


def _shifted(values: np.ndarray, rem: np.ndarray, shift: int) -> np.ndarray:
    """Return values[i + shift] where that position is in i's document, else 0."""
    out = np.zeros(values.shape[0], dtype=np.int64)
    out[: max(values.shape[0] - shift, 0)] = values[shift:]
    out[rem <= shift] = 0
    return out


def sort_suffixes(tokens: np.ndarray, doc_offsets: np.ndarray, *, key_length: int) -> np.ndarray:
    """Return all positions sorted by their first `key_length` tokens within their document, ties by position."""
    size = tokens.shape[0]
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    rem = _remaining(doc_offsets, size, key_length)
    bits = (int(tokens.max()) + 1).bit_length()
    span = min(key_length, 63 // bits)
    shifted_ids = tokens.astype(np.int64) + 1  # token + 1, so 0 means past the document end
    keys = np.zeros(size, dtype=np.int64)
    for j in range(span):  # pack the first tokens
        keys = (keys << bits) | _shifted(shifted_ids, rem, j)
    del shifted_ids
    rank_bits = (size + 1).bit_length()
    while span < key_length:
        rank = _dense_rank(keys)
        step = min(span, key_length - span)  # spans overlap: (rank of [i, i+span), rank of [i+step, ...))
        keys = (rank << rank_bits) | _shifted(rank, rem, step)
        span += step
    return np.argsort(keys, kind="stable")


class RestIndex:
    """Tokens, document offsets and the suffix array sorted by each suffix's first `max_suffix + 1` tokens."""

    def __init__(
        self, tokens: np.ndarray, doc_offsets: np.ndarray, sa: np.ndarray, heads: np.ndarray, *, max_suffix: int = 16
    ) -> None:
        self.tokens = tokens  # [N] int32
        self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)  # [D + 1]
        self.sa = sa  # [N] int32 or int64
        self.heads = np.asarray(heads, dtype=np.int64)  # [V + 1] first SA index of suffixes starting with v
        self.max_suffix = max_suffix
        self._tok = np.asarray(tokens).data
        self._sa = np.asarray(sa).data
        self._offsets = array("q", self.doc_offsets.tobytes())

    @classmethod
    def build(cls, tokens: np.ndarray, doc_offsets: np.ndarray, *, max_suffix: int = 16) -> RestIndex:
        """Sort all suffixes of the concatenated documents by their first `max_suffix + 1` in-document tokens."""
        flat = np.asarray(tokens)
        offsets = np.asarray(doc_offsets)
        if flat.ndim != 1 or offsets.ndim != 1 or not offsets.shape[0]:
            raise CorpusError("REST index needs a flat token array and document offsets [D + 1]")
        if flat.shape[0] and (int(flat.min()) < 0 or int(flat.max()) >= 2**31 - 1):
            raise CorpusError("token ids must lie in [0, 2**31 - 1)")
        if offsets[0] != 0 or offsets[-1] != flat.shape[0] or (np.diff(offsets) < 0).any():
            raise CorpusError("document offsets must rise from 0 to the number of tokens")
        if not 1 <= max_suffix <= 200:
            raise ConfigError(f"max_suffix must be in 1..200, not {max_suffix}")
        flat = np.ascontiguousarray(flat, dtype=np.int32)
        offsets = offsets.astype(np.int64)
        sa = sort_suffixes(flat, offsets, key_length=max_suffix + 1)
        dtype = np.int32 if flat.shape[0] < 2**31 else np.int64
        vocab = int(flat.max()) + 1 if flat.shape[0] else 0
        heads = np.concatenate(([0], np.cumsum(np.bincount(flat, minlength=vocab)))).astype(np.int64)
        return cls(flat, offsets, sa.astype(dtype), heads, max_suffix=max_suffix)

    @property
    def nbytes(self) -> int:
        """Return the bytes REST keeps: the token array plus the suffix array."""
        return int(self.tokens.nbytes + self.sa.nbytes)

    def save(self, path: Path | str) -> None:
        """Write the index as numpy files into directory `path`."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "tokens.npy", np.asarray(self.tokens))
        np.save(out / "sa.npy", np.asarray(self.sa))
        np.save(out / "doc_offsets.npy", self.doc_offsets)
        np.save(out / "heads.npy", self.heads)
        meta = {"format": FORMAT, "max_suffix": self.max_suffix, "tokens": len(self.tokens)}
        (out / "meta.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, path: Path | str) -> RestIndex:
        """Open an index written by `save`, memory-mapping its token and suffix arrays."""
        src = Path(path)
        meta = check_rest_index(src)
        try:
            tokens = np.load(src / "tokens.npy", mmap_mode="r")
            sa = np.load(src / "sa.npy", mmap_mode="r")
            offsets = np.load(src / "doc_offsets.npy")
            heads = np.load(src / "heads.npy")
            if not (tokens.shape == sa.shape == (int(meta["tokens"]),) and int(offsets[-1]) == tokens.shape[0]):
                raise ValueError("its arrays disagree in length")
            return cls(tokens, offsets, sa, heads, max_suffix=int(meta["max_suffix"]))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise _not_an_index(src, exc) from None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _key(self, pos: int, width: int) -> list[int]:
        """Return the first `width` tokens of the suffix at `pos`, cut at its document end."""
        end = self._offsets[bisect.bisect_right(self._offsets, pos)]
        return self._tok[pos : min(pos + width, end)].tolist()

    def _bucket(self, token: int) -> tuple[int, int]:
        if not 0 <= token < self.heads.shape[0] - 1:
            return 0, 0
        return int(self.heads[token]), int(self.heads[token + 1])

    def _lower(self, target: list[int], lo: int, hi: int) -> int:
        """Return the first SA index in [lo, hi) whose suffix key is >= `target`."""
        width = len(target)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(self._sa[mid], width) < target:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _upper(self, prefix: list[int], lo: int, hi: int) -> int:
        """Return the first SA index in [lo, hi) whose suffix does not start with `prefix` or less."""
        width = len(prefix)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(self._sa[mid], width) <= prefix:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def match_range(self, pattern: Sequence[int], *, continued: bool = False) -> tuple[int, int]:
        """Return the SA range [lo, hi) of suffixes whose in-document tokens start with `pattern`.

        With `continued`, only occurrences followed by at least one token in their document count.
        """
        prefix = [int(t) for t in pattern]
        if not 1 <= len(prefix) <= self.max_suffix:
            raise ValueError(f"pattern length must be in 1..{self.max_suffix}")
        lo, hi = self._bucket(prefix[0])
        lo = self._lower(prefix + [0] if continued else prefix, lo, hi)  # [0]: the smallest real next token
        return lo, self._upper(prefix, lo, hi)

    def longest_match(
        self, context: Sequence[int], *, min_suffix: int = 2, max_suffix: int = 16
    ) -> tuple[int, int, int]:
        """Return (m, lo, hi): the longest context suffix of m tokens with continued occurrences, and their SA range.

        Having a continued occurrence is monotone in m (drop the first token of one), so m is found by a
        binary search over lengths: about four range searches instead of fifteen. m = 0 when none matches.
        """
        ctx = [int(t) for t in context[len(context) - min(max_suffix, self.max_suffix, len(context)) :]]
        good, bad = min_suffix - 1, len(ctx) + 1  # lengths known to match / not to match
        found: dict[int, int] = {}
        while bad - good > 1:
            m = (good + bad) // 2
            prefix = ctx[len(ctx) - m :]
            lo, hi = self._bucket(prefix[0])
            at = self._lower(prefix + [0], lo, hi)
            if at < hi and self._key(self._sa[at], m) == prefix:
                good, found[m] = m, at
            else:
                bad = m
        if good < max(min_suffix, 1):
            return 0, 0, 0
        prefix = ctx[len(ctx) - good :]
        return good, found[good], self._upper(prefix, found[good], self._bucket(prefix[0])[1])

    def continuations(
        self, lo: int, hi: int, m: int, *, max_matches: int = 5000, length: int = 10, spread: bool = True
    ) -> np.ndarray:
        """Return the in-document continuations ([M, length], -1 padded) of the m-token matches sa[lo:hi]."""
        count = hi - lo
        if count <= 0 or max_matches <= 0:
            return np.zeros((0, length), dtype=np.int64)
        if count <= max_matches:
            picks = np.arange(lo, hi)
        elif spread:
            picks = lo + (np.arange(max_matches, dtype=np.int64) * count) // max_matches
        else:
            picks = np.arange(lo, lo + max_matches)
        starts = np.asarray(self.sa[picks], dtype=np.int64) + m  # [M]
        ends = self.doc_offsets[np.searchsorted(self.doc_offsets, starts - 1, side="right")]
        at = starts[:, None] + np.arange(length)  # [M, length]
        tokens = np.asarray(self.tokens)[np.minimum(at, max(len(self) - 1, 0))]
        return np.where(at < ends[:, None], tokens, -1).astype(np.int64)


def check_rest_index(path: Path | str) -> dict[str, Any]:
    """Return the metadata of the REST index in directory `path`, or raise ConfigError when it holds none."""
    src = Path(path)
    try:
        meta = json.loads((src / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}")
        return meta
    except (OSError, ValueError) as exc:
        raise _not_an_index(src, exc) from None


def _not_an_index(src: Path, exc: Exception) -> ConfigError:
    return ConfigError(f"{str(src)!r} is not a REST index directory ({', '.join(_FILES)}): {exc}")


class RestDrafter:
    """REST's drafting: longest context suffix (16 down to 2), up to 5000 matches, continuations of 10."""

    def __init__(
        self,
        index: RestIndex,
        *,
        max_suffix: int = 16,
        min_suffix: int = 2,
        max_matches: int = 5000,
        continuation_length: int = 10,
        tree_size: int = 64,
        spread: bool = True,
    ) -> None:
        if not 1 <= min_suffix <= max_suffix or max_matches < 1 or continuation_length < 1:
            raise ConfigError("REST drafting needs 1 <= min_suffix <= max_suffix, max_matches and length >= 1")
        self.index = index
        self.max_suffix = min(max_suffix, index.max_suffix)
        self.min_suffix = min_suffix
        self.max_matches = max_matches
        self.continuation_length = continuation_length
        self.tree_size = tree_size
        self.spread = spread

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return the one part behind this drafter's tree: the REST index."""
        return {"rest": tree} if tree is not None and len(tree) else {}

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the trie of the continuations of the longest matching context suffix, or None."""
        size = min(max_nodes, self.tree_size)
        if size <= 0:
            return None
        m, lo, hi = self.index.longest_match(context_ids, min_suffix=self.min_suffix, max_suffix=self.max_suffix)
        if m == 0:
            return None
        rows = self.index.continuations(
            lo, hi, m, max_matches=self.max_matches, length=self.continuation_length, spread=self.spread
        )
        tree = build_draft(rows, tree_size=size, n=m)
        return tree if len(tree) else None


def build_rest_index(inputs: Sequence[str], *, out: str, tokenizer: str, fmt: str) -> tuple[int, int]:
    """Tokenize a corpus and write its REST index to `out`; return (bytes, tokens)."""
    from crest.decoding.tokenizer import load_tokenizer
    from crest.ingest.corpus import CorpusReport, iter_documents
    from crest.ingest.tokenizer import tokenize_corpus

    target = Path(out).expanduser()
    made = _index_dir(target, out)
    try:
        tok = load_tokenizer(resolve_model_spec(tokenizer))
        with tempfile.TemporaryDirectory() as work:
            docs = iter_documents(inputs, fmt=fmt, report=CorpusReport())
            corpus = tokenize_corpus(docs, tok, workdir=Path(work))
            if corpus.tokens_total == 0:
                raise CorpusError("the corpus has no tokens")
            index = RestIndex.build(corpus.tokens, corpus.doc_offsets)
            try:
                save_replacing(index, target)
            except OSError as exc:
                raise ConfigError(f"cannot write the index into --out {out!r}: {exc.strerror or exc}") from None
    except BaseException:
        if made:  # no empty directory left by a failed build
            shutil.rmtree(target, ignore_errors=True)
        raise
    return index.nbytes, corpus.tokens_total


def save_replacing(index: RestIndex, target: Path) -> None:
    """Write `index` beside `target` and rename it into place, so `target` is the old index or the new one whole.

    `target` is an empty directory or an index (or a link to one); a failure leaves it as it was and no partial
    directory beside it. A directory whose parent is not writable is written in place, file by file.
    """
    target = target.resolve()
    try:
        fresh = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    except PermissionError:
        index.save(target)
        return
    old = fresh.with_suffix(".old")
    try:
        index.save(fresh)
        fresh.chmod(target.stat().st_mode & 0o7777)  # mkdtemp's 0700 would hide the index from other users
        if any(target.iterdir()):  # rename(2) replaces an empty directory only
            target.rename(old)
            try:
                fresh.rename(target)
            except OSError:
                old.rename(target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            fresh.replace(target)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def _index_dir(target: Path, out: str) -> bool:
    """Make the directory `--out` names (True) or accept an existing empty one or index (False); else ConfigError."""
    if not out.strip():  # Path("") is the working directory
        raise ConfigError("--out is empty: give the index directory")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {out!r} exists and is not a directory")
    if target.is_dir():
        try:
            names = {p.name for p in target.iterdir()}
        except OSError as exc:
            raise ConfigError(f"cannot read --out {out!r}: {exc.strerror or exc}") from None
        if names and ("meta.json" not in names or names - set(_FILES)):
            raise ConfigError(f"--out {out!r} holds other files than an index: give a new or empty directory")
        return False
    try:
        target.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --out {out!r}: {exc.strerror or exc}") from None
    return True


def _open_rest(path: str | Path, **_: Any) -> RestIndex:
    return RestIndex.load(path)


def _check_rest(path: str) -> None:
    check_rest_index(path)


register_part(
    Part(
        "rest_index",
        "--rest-index DIR (build one with `crest rest-index build`)",
        _open_rest,
        named_by="rest_index",
        check=_check_rest,
    )
)
