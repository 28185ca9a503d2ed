"""Choosing a Spark build's suffix rule on a judge corpus (`--engine spark --suffix-rule auto --suffix-judge FILE`).

The rule is chosen as in process (`crest.ingest.suffix_choice`): at seeded novel positions of the judge, the tree
each rule drafts from is matched against the tokens that follow. What needs the corpus runs on the executors:
the hashes of the judge's windows are broadcast and each token partition marks the ones its documents hold
(`seen_windows`; windows never cross a document, and no document crosses a partition), so the driver learns
which positions are novel without reading the corpus. What needs the rows is read from the version's table
after the load, before any pruning: the judged contexts' suffix keys (at most `POSITIONS * max_n`), whose rows
form a set closed under suffixes, so `prune_mask` over it keeps or drops each of them exactly as pruning the
whole table does. The driver holds the judge (at most `HELD_TOKENS` tokens) and those rows only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from crest_client.codec import TokenTable
from psycopg import sql

from crest import db
from crest.config import IngestOptions
from crest.ingest.novelty import JudgedWindows, judged_positions, seen_windows
from crest.ingest.suffix_choice import judge_by, sample_judge
from crest.ingest.suffixes import Row, prune_mask

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext


def choose_on_spark(
    parts: RDD[Any],
    judge: tuple[np.ndarray, np.ndarray],
    *,
    sc: SparkContext,
    dsn: str,
    store_id: int,
    options: IngestOptions,
    table: TokenTable,
    width: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """Return the figures of the rule (prune or longest) the loaded rows draft the judge better with.

    `parts` holds the corpus's token partitions ((index, tokens [N] int32, offsets [D + 1] int64, ...)).
    """
    text = sample_judge(*judge, seed=options.seed)
    windows = JudgedWindows.of(text, window=options.max_n)
    wanted, size = sc.broadcast(windows.wanted), 2 * options.max_n
    seen = parts.map(lambda p: seen_windows(p[1], p[2], wanted.value, size=size, chunk_tokens=chunk_tokens)).reduce(
        np.logical_or
    )
    wanted.unpersist()
    novel = windows.novel(seen)
    rows = judged_rows(text, novel, dsn=dsn, store_id=store_id, options=options, width=width)
    keep = prune_mask(rows, width=width, max_matches=options.max_matches)
    return judge_by(text, novel, options=options, table=table, width=width)(rows, keep)


def judged_rows(
    text: tuple[np.ndarray, np.ndarray],
    novel: np.ndarray,
    *,
    dsn: str,
    store_id: int,
    options: IngestOptions,
    width: int,
) -> list[Row]:
    """Return the version's rows of every suffix of the judged positions' contexts, shortest first."""
    tokens, offsets = text
    at, _ = judged_positions(offsets, novel, seed=options.seed)
    keys: set[bytes] = set()
    for start, p, _ in at:
        context = tokens[max(p - options.max_n, start) : p].astype(f">u{width}").tobytes()
        keys.update(context[cut:] for cut in range(0, len(context), width))
    if not keys:
        return []
    query = sql.SQL("SELECT key, n, count, tree FROM {} WHERE key = ANY(%s) ORDER BY n, key").format(
        db.ngram_table(store_id)
    )
    with db.session(dsn) as conn:
        found = conn.execute(query, (sorted(keys),)).fetchall()
    return [(bytes(key), int(n), int(count), bytes(tree)) for key, n, count, tree in found]
