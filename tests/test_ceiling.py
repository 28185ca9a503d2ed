"""The suffix ceiling (`crest.bench.ceiling`): its rules replay as the SDK's drafters do, and its ceiling is the
best stored suffix's tree at every step, restated through the public SDK alone (each suffix length looked up on
its own). Real PostgreSQL, the real SmolLM2 tokenizer, stores built from a slice of Python's standard library and
replayed on other modules of it."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path
from typing import Any

import psycopg
import pytest
from crest_client import Store

from crest.bench.ceiling import measure_ceiling
from crest.bench.replay import matched_depth, replay
from crest.config import IngestOptions
from crest.decoding.tree import limit_depth
from crest.drafters.store import StoreDrafter
from crest.ingest.pipeline import ingest

STDLIB = Path(sysconfig.get_path("stdlib"))
CORPUS = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "shlex.py", "argparse.py", "dataclasses.py"]
CORPUS += ["inspect.py"]
HELD_OUT = ["glob.py", "copy.py", "colorsys.py", "json/encoder.py"]  # replayed, never stored
NODES, NEW = 8, 48

pytest_plugins = ["tests.fix_corpus"]


def _build(dsn: str, root: Path, tokenizer: Path) -> None:
    """Build stores `every` (every row, `lookup`), `pruned` (pruned at ingest) and `every_v1` (format-1 blobs)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in CORPUS:
        shutil.copy(STDLIB / name, root / name.replace("/", "_"))
    for store, rule, blobs in (("every", "lookup", 2), ("pruned", "prune", 2), ("every_v1", "lookup", 1)):
        options = IngestOptions(top_t=20_000, max_matches=200, tree_size=NODES, suffix_rule=rule, blob_format=blobs)
        ingest([str(root)], store=store, tokenizer=str(tokenizer), dsn=dsn, options=options)


@pytest.fixture(scope="module")
def pairs(smollm2_tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) token ids cut from modules the stores never saw."""
    found = []
    for name in HELD_OUT:
        ids = smollm2_tokenizer.encode((STDLIB / name).read_text(encoding="utf-8"))
        for start in (200, 900):
            found.append((ids[start - 100 : start], ids[start : start + NEW]))
    return found


def _m(drafter: Any, pairs: list[tuple[list[int], list[int]]]) -> float:
    runs = [replay(drafter, p, o, max_nodes=NODES, max_new_tokens=NEW) for p, o in pairs]
    return round(sum(r.new_tokens for r in runs) / sum(r.steps for r in runs), 4)


def _hindsight_m(store: Store, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Return M when each step drafts from the best of the trees the SDK finds for every suffix length on its own."""
    tokens = steps = 0
    for prompt, out in pairs:
        done = 0
        while done < len(out):
            context, room = prompt + out[:done], len(out) - done - 1
            best = 0
            for k in range(1, store.info.max_n + 1):  # the longest stored suffix of the last k tokens
                tree = store.draft(context[-k:], max_nodes=NODES) if room > 0 else None
                if tree is not None and len(tree):
                    best = max(best, matched_depth(limit_depth(tree, room), out[done:]))
            done, steps = done + min(best, room) + 1, steps + 1
        tokens += len(out)
    return round(tokens / steps, 4)


def test_the_ceiling_is_the_best_stored_suffix_and_the_rules_replay_as_the_sdk(
    db_dsn: str, tmp_path: Path, smollm2_gguf: Path, pairs: Any
) -> None:
    _build(db_dsn, tmp_path, smollm2_gguf)
    stores = db_dsn
    with psycopg.connect(stores, autocommit=True) as conn:
        with Store.connect(stores, "every", cache_size=0, timeout=5.0) as store:
            found = measure_ceiling(store, conn, pairs, max_nodes=NODES, max_new_tokens=NEW)
        with Store.connect(stores, "every", cache_size=0, timeout=5.0, rule="longest") as store:
            hindsight = _hindsight_m(store, pairs)
        with Store.connect(stores, "pruned", cache_size=0, timeout=5.0) as store:
            pruned = measure_ceiling(store, conn, pairs, max_nodes=NODES, max_new_tokens=NEW)
        with Store.connect(stores, "every_v1", cache_size=0, timeout=5.0) as store:  # format-1 blobs, same trees
            v1 = measure_ceiling(store, conn, pairs, max_nodes=NODES, max_new_tokens=NEW)
    assert (v1.longest, v1.expected, v1.ceiling, v1.no_next) == (
        found.longest,
        found.expected,
        found.ceiling,
        found.no_next,
    )
    for rule in ("longest", "expected"):
        with Store.connect(stores, "every", cache_size=0, timeout=5.0, rule=rule) as handle:
            assert getattr(found, rule) == _m(StoreDrafter(handle), pairs), rule
    assert found.ceiling == hindsight
    assert found.ceiling > max(found.longest, found.expected) > 1.0  # the rules leave something on these modules
    assert (found.rule, pruned.rule, found.tokens, found.prompts) == ("lookup", "prune", NEW * len(pairs), len(pairs))
    assert 0.0 < found.no_suffix < found.no_next < 1.0
    # a pruned build drafts what `expected` drafts, one row per lookup: every rule reads the longest kept row
    assert pruned.longest == pruned.expected == found.expected
    assert pruned.expected <= pruned.ceiling <= found.ceiling


@pytest.mark.slow
def test_bench_ceiling_decodes_once_then_reads_the_references(
    db_dsn: str, tmp_path: Path, smollm2_gguf: Path, word_tokenizer_dir: Path
) -> None:
    import json

    from tests.fix_cli import run_cli

    _build(db_dsn, tmp_path / "corpus", smollm2_gguf)
    (tmp_path / "words.txt").write_text("the cat sat on the mat\n" * 20, encoding="utf-8")
    words = IngestOptions(top_t=100)
    ingest([str(tmp_path / "words.txt")], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=words)
    other = run_cli("bench", "ceiling", "-s", "every", "-s", "words", "--prompts", "humaneval", dsn=db_dsn)
    assert other.returncode == 2 and "another tokenizer" in other.stderr, other.stderr
    assert "plain greedy decoding" not in other.stderr  # refused before any decoding

    args = ["bench", "ceiling", "-s", "every", "-s", "pruned", "--prompts", "humaneval", "--limit", "2"]
    args += ["--max-new-tokens", "16", "--max-nodes", str(NODES), "--references", str(tmp_path / "refs"), "--json"]
    first, second = run_cli(*args, dsn=db_dsn), run_cli(*args, dsn=db_dsn)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "plain greedy decoding, prompt 2/2" in first.stderr and "read the plain greedy" in second.stderr
    rows = [json.loads(done.stdout)["rows"] for done in (first, second)]
    assert rows[0] == rows[1] and [r["store"] for r in rows[0]] == ["every", "pruned"]
    for row in rows[0]:
        assert row["tokens"] == 32 and 1.0 <= min(row["longest"], row["expected"]) <= row["ceiling"] <= 17.0
