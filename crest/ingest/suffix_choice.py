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
`lookup` so), and the choice and both estimates are recorded in the version's figures (`suffix_choice`). Under a
`--budget` the rules are compared at equal bytes: each on the rows it fills the budget with (`prune` counts only
the rows it keeps, so it reaches further down the ranks), and the store is loaded the chosen rule's way; a judge
corpus then gets a trial build of the whole corpus too, since which rows are loaded depends on the rule.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
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
from crest.ingest.novelty import judged_positions, novel_positions
from crest.ingest.suffixes import Choose, Row, prune_mask
from crest.ingest.tokenizer import tokenize_corpus

HELD_FRACTION = 0.01  # of the corpus's tokens held out of an `auto` build to choose its rule on
HELD_TOKENS = 200_000  # at most


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
    judge: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Return the figures of the rule a trial build drafts the judged text better with.

    Without `judge`, the trial is built from the corpus without its held-out slice and judged on that slice; with
    it, from the whole corpus and judged on `judge`. The trial's rows stay in memory (as many as the build itself
    reads back to resolve them); the store is then built from the whole corpus with the rule chosen. With a
    `--budget` each rule is judged on the rows it fills the budget with (`prune` reaches further down the ranks,
    since the rows it drops cost nothing): two trial loads, compared at equal bytes.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    if judge is None:
        b_tokens, b_offsets, *held = split_held_out(tokens, offsets, seed=options.seed)
        text, judged_on = (held[0], held[1]), "held-out"
    else:
        b_tokens, b_offsets, text, judged_on = tokens, offsets, judge, "judge"
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
    rules = ("prune", "lookup") if options.budget is not None else ("auto",)
    loaded: list[list[Row]] = []
    for rule in rules:
        trial.rows = []
        opts = replace(options, suffix_rule=rule)
        loader = RowLoader(trial, vocab_size, opts, chunk_tokens=chunk_tokens, min_count=min_count)
        loader.load(b_tokens, b_offsets, counts, trial)
        loaded.append(sorted(trial.rows, key=lambda row: row[1]))  # by n, as the build's table is read
    keep = prune_mask(loaded[0], width=loader.width, max_matches=options.max_matches)
    return choose_rule(
        loaded[0],
        keep,
        text,
        longest_rows=loaded[-1],
        **_judging(options, table=loader.table, width=loader.width, novel=novel, judged_on=judged_on),
    ).figures()


def loading_options(options: IngestOptions, figures: dict[str, Any] | None) -> IngestOptions:
    """Return the options an `auto` build loads its rows with: with a budget, the chosen rule's way of filling it."""
    if options.suffix_rule != "auto" or options.budget is None or figures is None:
        return options
    return replace(options, suffix_rule="prune" if figures["rule"] == "prune" else "lookup")


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
        return iter_documents(judge, report=CorpusReport())
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
    longest_rows: Sequence[Row] | None = None,
) -> Choice:
    """Return the rule whose trees match the held-out text better: `prune` (rows where `keep`) or `longest` (all).

    `novel` ([H] bools over the held-out tokens, `novel_positions`) limits the judged positions to novel ones;
    `longest_rows` are the rows `longest` reads when they are not `rows` (a budget filled by each rule's own way).
    """
    tokens, offsets = held
    trees = {key: (n, tree) for key, n, _, tree in rows}
    kept = {key for (key, *_), k in zip(rows, keep, strict=True) if k}
    if longest_rows is None:
        every: Collection[bytes] = trees
    else:
        every = {key for key, *_ in longest_rows}
        trees.update((key, (n, tree)) for key, n, _, tree in longest_rows)
    at, judged_novel = judged_positions(offsets, novel, seed=seed)
    decoded: dict[bytes, Draft] = {}
    scores = {"prune": 0, "longest": 0}
    for start, p, end in at:
        context = tokens[max(p - max_n, start) : p].astype(f">u{width}").tobytes()
        truth = tokens[p : min(end, p + length)].tolist()
        longest = pruned = None
        for cut in range(0, len(context), width):  # suffixes longest first
            suffix = context[cut:]
            if longest is None and suffix in every:
                longest = suffix
            if pruned is None and suffix in kept:
                pruned = suffix
            if longest is not None and pruned is not None:
                break
        for rule, key in (("longest", longest), ("prune", pruned)):
            if key is not None:
                if key not in decoded:
                    n, tree = trees[key]
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
        judging = _judging(options, table=table, width=width, novel=novel, judged_on=judged_on)
        return choose_rule(rows, keep, text, **judging).figures()

    return choose


def _judging(
    options: IngestOptions, *, table: TokenTable, width: int, novel: np.ndarray | None, judged_on: str
) -> dict[str, Any]:
    """Return `choose_rule`'s settings for a build of these options."""
    return {
        "width": width,
        "max_n": options.max_n,
        "length": options.continuation_length,
        "table": table if options.blob_format == 2 else None,
        "seed": options.seed,
        "novel": novel,
        "judged_on": judged_on,
    }
