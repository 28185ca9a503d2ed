"""Choosing a store's suffix rule at ingest on a held-out slice of its own corpus (`--suffix-rule auto`).

Neither client rule wins everywhere: the longest stored suffix drafts best from a small store, where long n-grams
are common ones, and the `expected` rule (which `prune` stores in one row a lookup) from a large one, where rare
long n-grams' thin trees shadow their suffixes' rich ones. `auto` decides per build, without the prompts it will
be measured on: a seeded slice of the corpus's documents (`HELD_FRACTION` of its tokens, at most `HELD_TOKENS`) is
left out of a trial build (its rows in memory), and at up to `POSITIONS` sampled positions of that slice the tree
each rule would draft from is matched against the tokens that follow there (`crest_client.merge.match_path`, what
greedy verification accepts). Only novel positions are judged: those whose `2 * max_n` tokens around them (the
longest context and as many tokens after it) occur nowhere in the trial's documents. A corpus repeats itself
(headers, idioms, near-copies between files, re-posted conversations), and at a verbatim repeat the longest
suffix's thin tree holds exactly what follows, so judged on every position the slice favours `longest` far more
than prompts that are not copies of the corpus do (on the standard library by 10%, where HumanEval favoured
`prune` by 5%). Without a novel position every position is judged. The rule with the higher mean accepted length
plus one (a proxy of M) is kept, `prune` on a tie (fewer bytes). The store is then built from the whole corpus
with that rule (so an `auto` build costs about two): `prune` drops the rows `expected` never drafts from, `longest`
keeps every row. Either way a lookup reads one row, the longest stored suffix (the client reads every rule but
`lookup` so), and the choice and both estimates are recorded in the version's figures (`suffix_choice`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from crest_client.codec import TokenTable, decode_tree
from crest_client.draft import Draft
from crest_client.merge import match_path

from crest.config import IngestOptions
from crest.errors import CorpusError
from crest.ingest.corpus import CorpusReport, Document, iter_documents
from crest.ingest.loader import Advance, Reporter, RowLoader
from crest.ingest.ngrams import count_ngrams
from crest.ingest.suffixes import Choose, Row, prune_mask
from crest.ingest.tokenizer import tokenize_corpus

HELD_FRACTION = 0.01  # of the corpus's tokens held out of an `auto` build to choose its rule on
HELD_TOKENS = 200_000  # at most
POSITIONS = 4000  # held-out positions the rules are compared at, at most
_PRIME = np.uint64(1099511628211)  # of the polynomial window hash (FNV's 64-bit prime)


@dataclass
class Choice:
    """The rule an `auto` build chose, and the held-out estimates it chose by."""

    rule: str  # prune | longest
    m_prune: float
    m_longest: float
    positions: int
    held_documents: int
    held_tokens: int
    novel: bool = False  # judged on novel positions only (`novel_positions`); False: every position was
    judged_on: str = "held-out"  # held-out (a slice of the corpus; held_* count it) | judge (--suffix-judge's text)

    def figures(self) -> dict[str, Any]:
        """Return the choice as the version's figures record it."""
        return asdict(self)


def choose_at_ingest(
    tokens: np.ndarray,
    offsets: np.ndarray,
    *,
    vocab_size: int,
    options: IngestOptions,
    chunk_tokens: int,
    reporter: Reporter,
    min_count: int = 1,
) -> dict[str, Any]:
    """Return the figures of the rule a trial build of the corpus without its held-out slice drafts it better with.

    The trial's rows stay in memory (as many as the build itself reads back to resolve them); the store is then
    built from the whole corpus with the rule chosen, so no document is left out of it.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    b_tokens, b_offsets, *held = split_held_out(tokens, offsets, seed=options.seed)
    text = (held[0], held[1])
    novel = novel_positions((b_tokens, b_offsets), text, window=options.max_n, chunk_tokens=chunk_tokens)
    trial = _Trial(reporter)
    counts = count_ngrams(
        b_tokens,
        b_offsets,
        max_n=options.max_n,
        vocab_size=vocab_size,
        progress=trial.stage("count n-grams", int(b_tokens.shape[0]) * options.max_n),
        chunk_tokens=chunk_tokens,
    )
    trial.done("count n-grams")
    loader = RowLoader(trial, vocab_size, options, chunk_tokens=chunk_tokens, min_count=min_count)
    loader.load(b_tokens, b_offsets, counts, trial)
    rows = sorted(trial.rows, key=lambda row: row[1])  # by n, as the build's table is read
    choose = judge_by(text, novel, options=options, table=loader.table, width=loader.width, judged_on="held-out")
    return choose(rows, prune_mask(rows, width=loader.width, max_matches=options.max_matches))


class _Trial:
    """The trial build's row sink (memory) and reporter (its stages named as the trial's)."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.rows: list[Row] = []

    def copy_ngrams(self, rows: Iterable[Row]) -> int:
        before = len(self.rows)
        self.rows.extend(rows)
        return len(self.rows) - before

    def stage(self, name: str, total: int | None) -> Advance:
        return self.reporter.stage(f"auto's trial: {name}", total)

    def done(self, name: str) -> None:
        self.reporter.done(f"auto's trial: {name}")


def split_held_out(
    tokens: np.ndarray, offsets: np.ndarray, *, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (build tokens, build offsets, held-out tokens, held-out offsets): whole documents, seeded.

    Documents are held out in a seeded order until `HELD_FRACTION` of the tokens (at most `HELD_TOKENS`) is; at
    least one document always stays in the build, and a corpus of one document holds nothing out.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    goal = min(HELD_TOKENS, int(HELD_FRACTION * int(offsets[-1]))) if offsets.shape[0] > 2 else 0
    held = _pick(offsets, goal, seed=seed, leave=1)
    return (*_take(tokens, offsets, ~held), *_take(tokens, offsets, held))


def judge_documents(judge: Sequence[str]) -> Iterator[Document] | None:
    """Return the documents of `--suffix-judge` (None without one); raise CorpusError naming the option."""
    if not judge:
        return None
    try:
        return iter_documents(list(judge), report=CorpusReport())
    except CorpusError as exc:
        raise CorpusError(f"--suffix-judge: {exc}") from None


def tokenize_judge(docs: Iterator[Document] | None, tok: Any, *, workdir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """Return the judge's (tokens, offsets) read from `docs` (None without any); raise CorpusError naming the option."""
    if docs is None:
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        text = tokenize_corpus(docs, tok, workdir=workdir)
    except CorpusError as exc:
        raise CorpusError(f"--suffix-judge: {exc}") from None
    return text.tokens, text.doc_offsets


def sample_judge(tokens: np.ndarray, offsets: np.ndarray, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the judge text `auto` reads: all of it, or seeded whole documents until `HELD_TOKENS` tokens are.

    Only `POSITIONS` positions are judged, so a larger judge adds nothing but the memory its windows take.
    """
    if int(offsets[-1]) <= HELD_TOKENS:
        return tokens, offsets
    return _take(tokens, offsets, _pick(offsets, HELD_TOKENS, seed=seed, leave=0))


def _pick(offsets: np.ndarray, goal: int, *, seed: int, leave: int) -> np.ndarray:
    """Return [D] bools: documents taken in a seeded order until `goal` tokens are, `leave` of them at least left."""
    docs = offsets.shape[0] - 1
    lengths = np.diff(offsets)
    picked = np.zeros(docs, dtype=bool)
    taken = count = 0
    for d in np.random.default_rng(seed).permutation(docs).tolist():
        if taken >= goal or count >= docs - leave:
            break
        picked[d], taken, count = True, taken + int(lengths[d]), count + 1
    return picked


def _take(tokens: np.ndarray, offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the tokens and offsets of the documents where `keep` holds, in order."""
    parts = [tokens[offsets[d] : offsets[d + 1]] for d in np.flatnonzero(keep).tolist()]
    lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
    joined = np.concatenate(parts).astype(tokens.dtype) if parts else np.zeros(0, tokens.dtype)
    return joined, np.r_[0, np.cumsum(lengths)].astype(np.int64)


def choose_rule(
    rows: Sequence[Row],
    keep: Sequence[bool],
    held: tuple[np.ndarray, np.ndarray],
    *,
    width: int,
    max_n: int,
    length: int,
    table: TokenTable | None,
    seed: int,
    novel: np.ndarray | None = None,
    judged_on: str = "held-out",
) -> Choice:
    """Return the rule whose trees match the held-out text better: `prune` (rows where `keep`) or `longest` (all).

    `novel` ([H] bools over the held-out tokens, `novel_positions`) limits the judged positions to novel ones.
    """
    tokens, offsets = held
    stored = {key: (n, tree, kept) for (key, n, _, tree), kept in zip(rows, keep, strict=True)}
    at, judged_novel = judged_positions(offsets, novel, seed=seed)
    decoded: dict[bytes, Draft] = {}
    scores = {"prune": 0, "longest": 0}
    for start, p, end in at:
        context = tokens[max(p - max_n, start) : p].astype(f">u{width}").tobytes()
        truth = tokens[p : min(end, p + length)].tolist()
        longest = pruned = None
        for cut in range(0, len(context), width):  # suffixes longest first
            found = stored.get(context[cut:])
            if found is None:
                continue
            if longest is None:
                longest = context[cut:]
            if found[2]:
                pruned = context[cut:]
                break
        for rule, key in (("longest", longest), ("prune", pruned)):
            if key is not None:
                if key not in decoded:
                    n, tree, _ = stored[key]
                    decoded[key] = decode_tree(tree, n=n, table=table)
                scores[rule] += len(match_path(decoded[key], truth))
    count = max(1, len(at))
    m_prune, m_longest = 1 + scores["prune"] / count, 1 + scores["longest"] / count
    return Choice(
        rule="prune" if m_prune >= m_longest else "longest",
        m_prune=round(m_prune, 4),
        m_longest=round(m_longest, 4),
        positions=len(at),
        held_documents=int(offsets.shape[0] - 1),
        held_tokens=int(offsets[-1]) if offsets.shape[0] else 0,
        novel=judged_novel,
        judged_on=judged_on,
    )


def made_before(figures: dict[str, Any]) -> Choose:
    """Return a choice made before the build (`choose_at_ingest`) as `resolve_build` asks for it."""
    return lambda rows, keep: figures


def judge_by(
    text: tuple[np.ndarray, np.ndarray],
    novel: np.ndarray | None,
    *,
    options: IngestOptions,
    table: TokenTable,
    width: int,
    judged_on: str = "judge",
) -> Choose:
    """Return auto's choice on `text` (a judge corpus, or a held-out slice): rows and prune's mask -> its figures."""

    def choose(rows: Sequence[Row], keep: Sequence[bool]) -> dict[str, Any]:
        return choose_rule(
            rows,
            keep,
            text,
            width=width,
            max_n=options.max_n,
            length=options.continuation_length,
            table=table if options.blob_format == 2 else None,
            seed=options.seed,
            novel=novel,
            judged_on=judged_on,
        ).figures()

    return choose


def novel_positions(
    build: tuple[np.ndarray, np.ndarray],
    held: tuple[np.ndarray, np.ndarray],
    *,
    window: int,
    chunk_tokens: int = 1 << 22,
) -> np.ndarray:
    """Return [H] bools: the held-out positions p whose tokens [p - window, p + window) lie in p's document and
    occur in no build document.

    Windows are compared by a 64-bit polynomial hash; the build is read in chunks of `chunk_tokens` windows, so
    memory stays bounded by the chunk and the held-out slice, not the corpus.
    """
    # build, held: (tokens [N] int32, offsets [D + 1] int64)
    windows = JudgedWindows.of(held, window=window)
    return windows.novel(seen_windows(*build, windows.wanted, size=2 * window, chunk_tokens=chunk_tokens))


@dataclass
class JudgedWindows:
    """The windows around a judged text's positions: where each starts, and their distinct hashes."""

    positions: int  # H, the judged text's tokens
    window: int
    starts: np.ndarray  # [W] int64 starts of the windows inside one document
    wanted: np.ndarray  # [U] uint64 distinct window hashes, sorted
    first: np.ndarray  # [W] index into `wanted` of each window's hash

    @classmethod
    def of(cls, held: tuple[np.ndarray, np.ndarray], *, window: int) -> JudgedWindows:
        """Return the windows of `2 * window` tokens of the judged text (tokens, offsets)."""
        tokens, offsets = held
        size = 2 * window
        starts = _window_starts(offsets, 0, max(tokens.shape[0] - size + 1, 0), size)  # [W] inside a document
        hashes = _window_hashes(tokens, starts, size)
        wanted, first = np.unique(hashes, return_inverse=True)
        return cls(int(tokens.shape[0]), window, starts, wanted, first.reshape(-1))

    def novel(self, seen: np.ndarray) -> np.ndarray:
        """Return [H] bools: the positions whose window is not `seen` ([U] bools over `wanted`)."""
        found = np.zeros(self.positions, dtype=bool)
        if self.starts.shape[0]:
            found[self.starts + self.window] = ~seen[self.first]
        return found


def seen_windows(
    tokens: np.ndarray, offsets: np.ndarray, wanted: np.ndarray, *, size: int, chunk_tokens: int = 1 << 22
) -> np.ndarray:
    """Return [U] bools: which of the `wanted` window hashes (sorted) occur in these documents' windows of `size`.

    The documents are read in chunks of `chunk_tokens` windows, so memory stays bounded by the chunk.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    seen = np.zeros(wanted.shape[0], dtype=bool)
    if not wanted.shape[0]:
        return seen
    total = max(int(tokens.shape[0]) - size + 1, 0)
    for lo in range(0, total, chunk_tokens):
        at = _window_starts(offsets, lo, min(lo + chunk_tokens, total), size)
        got = _window_hashes(tokens, at, size)
        where = np.minimum(np.searchsorted(wanted, got), wanted.shape[0] - 1)
        seen[where[wanted[where] == got]] = True
    return seen


def _window_starts(offsets: np.ndarray, lo: int, hi: int, size: int) -> np.ndarray:
    """Return the starts q in [lo, hi) whose `size` tokens lie inside one document."""
    q = np.arange(lo, hi, dtype=np.int64)
    doc = np.searchsorted(offsets, q, side="right") - 1  # [Q] the document each window starts in
    return q[q + size <= offsets[np.minimum(doc + 1, offsets.shape[0] - 1)]]


def _window_hashes(tokens: np.ndarray, starts: np.ndarray, size: int) -> np.ndarray:
    """Return the 64-bit hash of tokens[q : q + size] for each start q (uint64 arithmetic wraps)."""
    h = np.zeros(starts.shape[0], dtype=np.uint64)
    for k in range(size):
        h = h * _PRIME + tokens[starts + k].astype(np.uint64) + np.uint64(1)
    return h


def judged_positions(
    offsets: np.ndarray, novel: np.ndarray | None, *, seed: int
) -> tuple[list[tuple[int, int, int]], bool]:
    """Return up to `POSITIONS` seeded (its document's start, position, its document's end) with a token before and
    one after, novel ones only when `novel` marks any, and whether they are."""
    at = np.arange(int(offsets[-1]) if offsets.shape[0] else 0, dtype=np.int64)
    doc = np.searchsorted(offsets, at, side="right") - 1  # [H] the document of each held-out token
    usable = at > offsets[doc]  # p with start < p < end
    judged_novel = novel is not None and bool(np.count_nonzero(novel & usable))
    if judged_novel:
        assert novel is not None
        usable &= novel
    candidates = at[usable]
    if candidates.shape[0] == 0:
        return [], False
    count = candidates.shape[0]
    p = candidates[np.sort(np.random.default_rng(seed).choice(count, size=min(POSITIONS, count), replace=False))]
    spans = offsets[doc[p]].tolist(), p.tolist(), offsets[doc[p] + 1].tolist()
    return list(zip(*spans, strict=True)), judged_novel
