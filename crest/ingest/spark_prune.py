"""Pruning a Spark build by the `expected` rule on the executors (`crest ingest --engine spark --suffix-rule prune`).

The rule is `crest.ingest.suffixes.kept_by_prune`, as in process: a row stays when it outranks every stored proper
suffix of it. In process one pass over all rows, shortest first, carries each key's best rank; here the rows stay
on the executors: each loaded row's rank (`crest_client.choice.rank`, read from its blob's header) is kept beside
its key, each row asks for the ranks of its proper suffixes (a join on the suffix key), the best answer per row is
compared with its own, and each partition of the dropped rows deletes them from the version's table in one
statement (a temporary table of their keys, so one scan of the table per partition; a retried task deletes
nothing twice). The driver then rewrites the table (VACUUM FULL: the in-process engine rewrites it too) and
receives, per partition, what was dropped: the figures and the key filter count the rows left only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from crest_client.choice import rank
from psycopg import sql

from crest import db
from crest.ingest.spark_tasks import Rows
from crest.ingest.suffixes import Rank, kept_by_prune

if TYPE_CHECKING:
    from pyspark import RDD

Record = tuple[Rank, int, int, int, int]  # (rank, count, nodes, blob bytes, key filter hash) of a loaded row


@dataclass
class Pruned:
    """What pruning dropped: rows and covered positions per n, nodes, blob bytes, and the rows' key hashes."""

    kept: dict[int, int] = field(default_factory=dict)
    covered: dict[int, int] = field(default_factory=dict)
    nodes: int = 0
    blob_bytes: int = 0
    hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # [D] uint64

    def add(self, other: Pruned) -> Pruned:
        """Return both counted together."""
        ns = set(self.kept) | set(other.kept)
        return Pruned(
            {n: self.kept.get(n, 0) + other.kept.get(n, 0) for n in ns},
            {n: self.covered.get(n, 0) + other.covered.get(n, 0) for n in ns},
            self.nodes + other.nodes,
            self.blob_bytes + other.blob_bytes,
            np.concatenate([self.hashes, other.hashes]),
        )

    def left(self, hashes: np.ndarray) -> np.ndarray:
        """Return the key filter hashes of the loaded rows less the dropped ones."""
        return hashes[~np.isin(hashes, self.hashes)]


def row_records(rows: Rows, *, max_matches: int) -> Iterator[tuple[bytes, Record]]:
    """Yield (key, record) for each loaded row: what pruning needs of it."""
    for key, count, blob, nodes, h in zip(
        rows.keys, rows.counts.tolist(), rows.blobs, rows.nodes.tolist(), rows.hashes.tolist(), strict=True
    ):
        yield key, (rank(rows.n, count, blob, max_matches=max_matches), count, nodes, len(blob), h)


def prune_rows(records: RDD[Any], *, dsn: str, store_id: int, width: int, partitions: int) -> Pruned:
    """Delete the loaded rows `prune` drops (records: (key, Record) of every row) and return what they were."""
    ranks = records.mapValues(lambda r: r[0])
    asks = records.flatMap(lambda kv: [(kv[0][c:], kv[0]) for c in range(width, len(kv[0]), width)])
    best = (  # (key, best rank among its stored proper suffixes); rows with none stored are absent: they stay
        asks.join(ranks, numPartitions=partitions).map(lambda kv: kv[1]).reduceByKey(max, numPartitions=partitions)
    )
    dropped = records.join(best, numPartitions=partitions).filter(lambda kv: not kept_by_prune(kv[1][0][0], kv[1][1]))

    def delete(items: Iterable[Any]) -> Iterator[Pruned]:
        yield delete_rows(dsn, store_id, [(key, record) for key, (record, _) in items], width=width)

    out = Pruned()
    for part in dropped.mapPartitions(delete).collect():
        out = out.add(part)
    with db.session(dsn, autocommit=True) as conn:  # the deleted rows' space back, as TRUNCATE + COPY in process
        conn.execute(sql.SQL("VACUUM FULL {}").format(db.ngram_table(store_id)))
    return out


def delete_rows(dsn: str, store_id: int, rows: list[tuple[bytes, Record]], *, width: int) -> Pruned:
    """Delete these rows from the version's table in one statement; return what they were."""
    out = Pruned(hashes=np.asarray([r[4] for _, r in rows], dtype=np.uint64))
    for key, (_, count, nodes, size, _) in rows:
        n = len(key) // width
        out.kept[n] = out.kept.get(n, 0) + 1
        out.covered[n] = out.covered.get(n, 0) + count
        out.nodes += nodes
        out.blob_bytes += size
    if not rows:
        return out
    with db.session(dsn) as conn, conn.transaction():
        conn.execute("CREATE TEMPORARY TABLE crest_dropped (key bytea) ON COMMIT DROP")
        with conn.cursor() as cur, cur.copy("COPY crest_dropped (key) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["bytea"])
            for key, _ in rows:
                copy.write_row((key,))
        conn.execute(
            sql.SQL("DELETE FROM {} AS t USING crest_dropped AS d WHERE t.key = d.key").format(db.ngram_table(store_id))
        )
    return out
