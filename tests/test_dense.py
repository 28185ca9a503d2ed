"""Dense retrieval drafting on real PostgreSQL with pgvector and a tiny random model: ingest, ANN, drafters, faults."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
import torch

from crest.db import dense as dense_db
from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.hidden import model_fingerprint
from crest.drafters.dense import DenseDrafter, neighbour_draft
from crest.drafters.dense_index import DenseIndex, open_dense
from crest.drafters.registry import close_drafter, make_drafter, open_drafter
from crest.errors import ConfigError, ModelError
from crest.ingest.dense import sample_positions
from crest.ingest.pipeline import ingest
from tests.fix_corpus import write_jsonl
from tests.fix_dense import DENSE_DRAFTERS, OPTIONS, PROMPTS, WORDS, column_type, ingest_dense, save_tiny
from tests.fix_proxy import Proxy

pytest_plugins = ["tests.fix_dense"]


def test_sample_positions_draw_whole_windows_with_two_tokens_after_each_position() -> None:
    offsets = np.array([0, 5, 5, 6, 20], dtype=np.int64)  # lengths 5, 0, 1, 14
    everything = sample_positions(offsets, count=1000, seed=1, window=4)
    assert everything.tolist() == [0, 1, 2, *range(6, 18)]  # every valid position once, sorted
    few = sample_positions(offsets, count=4, seed=1, window=4)
    assert len(few) == 4 and set(few.tolist()) <= set(everything.tolist())
    windows = {(int(p) - 6) // 4 for p in sample_positions(offsets, count=8, seed=2, window=4) if p >= 6}
    assert len(windows) <= 3  # whole windows of the 14-token document, not scattered positions
    assert sample_positions(np.array([0, 2, 3]), count=5, seed=0, window=4).shape == (0,)


@pytest.mark.parametrize("precision", ["half", "single"])
def test_ingest_publishes_a_dense_part_with_the_model_fingerprint_and_unit_vectors(
    db_dsn: str, corpus: Path, tiny_dir: Path, loaded: Any, precision: str
) -> None:
    dense_store = ingest_dense(db_dsn, corpus, tiny_dir, precision=precision)
    vector = dense_db.PRECISIONS[precision]  # the column type; float16 rounds each component by up to ~5e-4
    assert column_type(db_dsn, dense_store.store_id) == f"{vector}(16)"
    with psycopg.connect(db_dsn) as conn:
        meta = dense_db.read_meta(conn, dense_store.store_id)
        assert meta is not None and meta.dims == 16 and meta.continuation == 8
        assert meta.model_fingerprint == model_fingerprint(loaded.model)
        rows = conn.execute(f"SELECT embedding::text, continuation FROM crest_dense_s{dense_store.store_id}").fetchall()
        assert meta.figures["rows"] == len(rows) == dense_store.tokens - 2 * dense_store.documents
        norms = [np.linalg.norm(json.loads(text)) for text, _ in rows]
        assert np.allclose(norms, 1.0, atol=2e-3 if precision == "half" else 1e-4)
        assert all(2 <= len(cont) <= 8 for _, cont in rows)
        held = conn.execute(f"SELECT DISTINCT pg_column_size(embedding) FROM crest_dense_s{dense_store.store_id}")
        width = 2 if precision == "half" else 4  # bytes a component; 5 bytes of header on disk (short varlena)
        assert held.fetchall() == [(5 + 16 * width,)]
        index = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = %s", (f"crest_dense_s{dense_store.store_id}",)
        ).fetchone()
        assert index is not None and "USING ivfflat" in index[0]  # the default index, recorded with the part
        assert meta.index.kind == "ivfflat" and meta.figures["index"]["lists"] == meta.index.lists >= 1
        assert meta.index.vector == vector and meta.figures["options"]["precision"] == precision  # recorded
        assert meta.figures["options"]["device"] == "cpu" and meta.figures["device"] == "cpu"  # the default


@pytest.mark.parametrize("vector", dense_db.VECTOR_TYPES)
@pytest.mark.parametrize("kind", dense_db.INDEX_KINDS)
def test_ann_recall_against_exact_search(db_dsn: str, kind: str, vector: str) -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(40, 64))  # clustered, as hidden states are
    vectors = (centres[rng.integers(0, 40, 4000)] + 0.7 * rng.normal(size=(4000, 64))).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with psycopg.connect(db_dsn) as conn:
        dense_db.ensure_vector(conn)
        dense_db.create_table(conn, 999_999, dims=64, vector=vector)
        dense_db.copy_rows(conn, 999_999, ((v, [i, i + 1]) for i, v in enumerate(vectors)))
        index = dense_db.AnnIndex.for_rows(kind, len(vectors), vector=vector)  # IVFFlat: 40 lists, 20 probed
        dense_db.finish_table(conn, 999_999, index=index)
        queries = vectors[:50] + 0.5 * rng.normal(size=(50, 64)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        dense_db.tune(conn, index)
        approx = dense_db.search(conn, 999_999, queries, k=10, vector=vector)
        exact = dense_db.search(conn, 999_999, queries, k=10, exact=True, vector=vector)
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                f"EXPLAIN SELECT 1 FROM crest_dense_s999999 ORDER BY embedding <#> %s::{vector} LIMIT 10",
                (dense_db.vector_text(queries[0]),),
            )
        )
    assert f"crest_dense_s999999_{kind}" in plan  # the index answers, not a scan
    assert column_type(db_dsn, 999_999) == f"{vector}(64)"  # the precision asked for is the one searched
    truth = np.argsort(-(queries @ vectors.T), axis=1)[:, :10]  # float32
    held = np.float16 if vector == "halfvec" else np.float32  # what the column holds and the query is cast to
    stored, asked = (x.astype(held).astype(np.float32) for x in (vectors, queries))
    exactly = np.argsort(-(asked @ stored.T), axis=1)[:, :10]
    assert [[c[0] for c, _ in row] for row in exact] == exactly.tolist()  # exact search is exact
    recall = np.mean([len({c[0] for c, _ in a} & set(t.tolist())) / 10 for a, t in zip(approx, truth, strict=True)])
    assert recall >= 0.9, recall
    assert all(row[0][1] >= row[-1][1] for row in approx)  # best first


@pytest.mark.parametrize("vector", dense_db.VECTOR_TYPES)
def test_a_batch_too_big_for_one_query_vector_is_split_and_answers_alike(
    db_dsn: str, vector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(300, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[:10] + 0.3 * rng.normal(size=(10, 16)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        dense_db.ensure_vector(conn)
        dense_db.create_table(conn, 999_998, dims=16, vector=vector)
        dense_db.copy_rows(conn, 999_998, ((v, [i]) for i, v in enumerate(vectors)))  # no index: exact scans
        whole = dense_db.search(conn, 999_998, queries, k=5, vector=vector)
        monkeypatch.setattr(dense_db, "QUERY_COMPONENTS", 3 * 16)  # 3 queries a statement: 4 statements
        split = dense_db.search(conn, 999_998, queries, k=5, vector=vector)
    held = np.float16 if vector == "halfvec" else np.float32  # the column's and the packed queries' precision
    stored, asked = (x.astype(held).astype(np.float32) for x in (vectors, queries))
    truth = np.argsort(-(asked @ stored.T), axis=1)[:, :5]
    assert [[c[0] for c, _ in row] for row in whole] == truth.tolist()  # each query answered as its own
    assert split == whole


def test_neighbour_draft_keeps_agreeing_neighbours_weighted_by_similarity() -> None:
    found = [([5, 6, 7], 0.9), ([4, 9], 0.8), ([5, 6, 8], 0.5), ([5, 3], 0.2)]
    tree = neighbour_draft(found, 5, tree_size=10)
    assert tree is not None and tree.total == 900 + 800 + 500 + 200
    assert tree.paths() == [[6], [6, 7], [6, 8], [3]]
    assert tree.weights.tolist() == [1400, 900, 500, 200]
    assert neighbour_draft(found, 11) is None


@pytest.mark.parametrize(("name", "precision"), [*((n, "half") for n in DENSE_DRAFTERS), ("dense", "single")])
def test_greedy_output_is_exact_with_every_dense_drafter(
    db_dsn: str, corpus: Path, tiny_dir: Path, loaded: Any, name: str, precision: str
) -> None:
    built = ingest_dense(db_dsn, corpus, tiny_dir, precision=precision)
    assert column_type(db_dsn, built.store_id).startswith(dense_db.PRECISIONS[precision])
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, adaptive=False, max_draft_tokens=24)
    drafter = open_drafter(name, store="words", dsn=db_dsn)
    drafted = accepted = 0
    try:
        for prompt in [*PROMPTS, "w2 w9 w9 w4 w0"]:
            ids = loaded.tokenizer(prompt)["input_ids"]
            plain = gen.generate(ids, max_new_tokens=30)
            spec = gen.generate(ids, drafter=drafter, max_new_tokens=30)
            assert spec.output_token_ids == plain.output_token_ids, (name, prompt)
            drafted += spec.draft_tokens
            accepted += spec.new_tokens - spec.forward_passes
    finally:
        close_drafter(drafter)
    assert drafted > 0 and accepted > 30  # the model's own continuations are found and accepted


def test_dense_alone_drafts_its_model_outputs(db_dsn: str, dense_store: Any, loaded: Any) -> None:
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, adaptive=False, max_draft_tokens=24)
    index = open_dense("words", dsn=db_dsn)
    drafter = make_drafter("dense", dense_index=index)
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]
    try:
        result = gen.generate(ids, drafter=drafter, max_new_tokens=30)
        assert result.mean_accepted_length > 2.0  # the corpus holds this very continuation
        parts = drafter.drafted_parts(drafter.draft([0], 4), context_length=1)  # type: ignore[attr-defined]
        assert parts == {}  # no hidden state for that context: no draft, no part
    finally:
        index.close()


def test_another_model_than_the_dense_parts_is_a_clear_error(
    db_dsn: str, dense_store: Any, tmp_path: Path, loaded: Any
) -> None:
    from crest.decoding.models import load_model

    other = load_model(str(save_tiny(tmp_path / "other", seed=4)))
    gen = SpeculativeGenerator(other.model, other.tokenizer, adaptive=False)
    drafter = open_drafter("crest+dense+prompt", store="words", dsn=db_dsn)
    try:
        with pytest.raises(ModelError, match="dense part was built with model"):
            gen.generate([2, 3, 4], drafter=drafter, max_new_tokens=4)
    finally:
        close_drafter(drafter)


def test_a_store_without_a_dense_part_is_a_clear_error(db_dsn: str, corpus: Path, tiny_dir: Path) -> None:
    ingest([str(corpus)], store="plain", tokenizer=str(tiny_dir), dsn=db_dsn, options=OPTIONS)
    for name in ("dense", "crest+dense"):  # crest+dense opens the store first: it is closed again
        with pytest.raises(ConfigError, match="has no dense part"):
            open_drafter(name, store="plain", dsn=db_dsn)
    gc.collect()  # a store or connection left open would warn here: an error in this suite


def test_database_down_means_no_drafts_and_no_error(db_dsn: str, dense_store: Any, loaded: Any) -> None:
    proxy, via = Proxy.fronting(db_dsn)
    index = open_dense("words", dsn=via, retry_interval=0.0)  # down from the start: said once, no error
    drafter = DenseDrafter(index)
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, adaptive=False, max_draft_tokens=16)
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]
    plain = gen.generate(ids, max_new_tokens=20)
    down = gen.generate(ids, drafter=drafter, max_new_tokens=20)
    assert down.output_token_ids == plain.output_token_ids and down.draft_tokens == 0
    proxy.up()
    try:
        up = gen.generate(ids, drafter=drafter, max_new_tokens=20)
        assert up.output_token_ids == plain.output_token_ids and up.draft_tokens > 0  # answers again: drafts
        index.retry_interval = 3600.0  # no reconnecting within this test (a closed listener may still accept)
        proxy.down()  # goes down mid-use: the open connection breaks
        again = gen.generate(ids, drafter=drafter, max_new_tokens=20)
        assert again.output_token_ids == plain.output_token_ids and again.draft_tokens == 0
    finally:
        proxy.down()
        index.close()


def test_a_new_version_is_picked_up_once_the_old_one_is_dropped(
    db_dsn: str, dense_store: Any, corpus: Path, tiny_dir: Path
) -> None:
    index = DenseIndex("words", dsn=db_dsn).open()
    assert index.meta is not None and index.meta.store_id == dense_store.store_id
    newer = ingest_dense(db_dsn, corpus, tiny_dir, positions=50)
    hidden = np.zeros((1, index.meta.hidden_size), dtype=np.float32)
    assert index.search(hidden, k=4) == [[]]  # the old version's table is gone: nothing this once
    assert len(index.search(hidden, k=4)[0]) == 4 and index.meta.store_id == newer.store_id
    index.close()


def _wait_unlocked(dsn: str, timeout: float = 30.0) -> None:
    """Wait until no session holds a build's liveness lock (the server noticed the killed client)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objsubid = 2",
                (0x4352,),
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.05)
    pytest.fail("the killed ingest's session still holds its lock")


@pytest.mark.slow  # a `crest` subprocess that loads torch and the model, 10-60 s
def test_killed_dense_build_leaves_the_previous_version_and_is_cleaned_up(
    db_dsn: str, dense_store: Any, corpus: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    args = [sys.executable, "-m", "crest.cli", "ingest", str(corpus), "--store", "words", "--tokenizer",
            str(tiny_dir), "--top-t", "1000", "--max-n", "3", "--quiet", "--dense-model", str(tiny_dir),
            "--dense-dims", "8"]  # fmt: skip
    env = {
        **os.environ,
        "CREST_DATABASE_URL": db_dsn,
        "CREST_HOME": str(tmp_path / "home"),
        "CREST_FAULT_PAUSE": "dense",
    }
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stderr or ():
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    said: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "crest-fault-pause dense\n" not in said and proc.poll() is None:
        with contextlib.suppress(queue.Empty):
            said.append(lines.get(timeout=0.5))
    proc.kill()
    proc.wait()
    reader.join(30)  # the pipe ends with the process
    proc.stderr.close()
    assert "crest-fault-pause dense\n" in said, "".join(said)[-2000:]
    _wait_unlocked(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        found = conn.execute("SELECT id, state FROM crest_stores WHERE name = 'words'").fetchall()
        states: dict[int, str] = dict(found)
        killed = max(states)
        assert states == {dense_store.store_id: "published", killed: "building"}
        assert conn.execute("SELECT to_regclass(%s)", (f"crest_dense_s{killed}",)).fetchone() != (None,)
        index = DenseIndex("words", dsn=db_dsn).open()  # readers still get the previous dense part
        assert index.meta is not None and index.meta.store_id == dense_store.store_id
        index.close()
        from crest.db.versions import clean_leftovers

        assert clean_leftovers(conn) == [killed]
        assert conn.execute("SELECT to_regclass(%s)", (f"crest_dense_s{killed}",)).fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM crest_dense").fetchone() == (1,)


def test_replay_comparison_measures_every_drafter_and_the_batched_lookup(
    db_dsn: str, dense_store: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    from crest.bench.dense import compare

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    figures = compare(
        str(tiny_dir), store="words", dsn=db_dsn, prompts=str(prompts), limit=3, max_new_tokens=20, batch=4
    )
    assert set(figures["M"]) == {"crest", "crest+prompt", "dense", "crest+dense", "crest+dense+prompt"}
    assert figures["M"]["dense"] > 2.0  # the store holds these very continuations
    assert figures["lookup_ms"]["batch"] == 4 and 0 < figures["lookup_ms"]["p50"] <= figures["lookup_ms"]["p95"]


def test_sql_dense_reports_the_dense_part_size(db_dsn: str, dense_store: Any) -> None:
    sql_file = Path(__file__).resolve().parent.parent / "sql" / "dense.sql"
    with psycopg.connect(db_dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        conn.execute(f"ANALYZE crest_dense_s{dense_store.store_id}")
        rows = cur.execute(sql_file.read_text()).fetchall()
    assert len(rows) == 1 and rows[0]["version"] == dense_store.store_id and rows[0]["dims"] == 16
    assert rows[0]["index_kind"] == "ivfflat" and rows[0]["precision"] == "half"  # the default
    assert rows[0]["rows_estimate"] == dense_store.tokens - 2 * dense_store.documents
    assert rows[0]["table_bytes"] > 0 and rows[0]["index_bytes"] > 0 and rows[0]["bytes_per_row"] > 16 * 4


def test_a_part_recorded_without_a_precision_reads_as_single(db_dsn: str, corpus: Path, tiny_dir: Path) -> None:
    built = ingest_dense(db_dsn, corpus, tiny_dir, precision="single")
    with psycopg.connect(db_dsn) as conn:  # as a part built before the choice existed records its index
        conn.execute("UPDATE crest_dense SET figures = figures #- '{index,vector}' #- '{options,precision}'")
    index = open_dense("words", dsn=db_dsn)
    try:
        assert index.meta is not None and "vector" not in index.meta.figures["index"]
        assert index.meta.index.vector == "vector" and column_type(db_dsn, built.store_id) == "vector(16)"
        found = index.search(np.ones((2, index.meta.hidden_size), dtype=np.float32), k=3)
        assert [len(row) for row in found] == [3, 3]  # a float32 query on the float32 column: neighbours, no error
    finally:
        index.close()


@pytest.mark.parametrize(("option", "env"), [(["--dense-precision", "double"], {}), ([], {"precision": "double"})])
def test_a_bad_dense_precision_is_a_clear_error(
    corpus: Path,
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    option: list[str],
    env: dict[str, str],
) -> None:
    from tests.fix_cli import one_error_line, run

    monkeypatch.setenv("CREST_HOME", str(tmp_path))
    for value in env.values():
        monkeypatch.setenv("CREST_DENSE_PRECISION", value)
    args = ["ingest", str(corpus), "--store", "w", "--tokenizer", str(tiny_dir), "--dense-model", str(tiny_dir)]
    code, _, err = run(monkeypatch, capsys, *args, *option)
    assert code == 2  # ConfigError, before anything is read or built
    assert "--dense-precision must be one of half, single, not 'double'" in one_error_line(err)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--dense-device: unknown device 'tpu'"),
        pytest.param(
            "cuda",
            "--dense-device: device 'cuda' asked for, but no CUDA device is available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
    ids=["unknown", "absent"],
)
def test_a_bad_dense_device_is_a_clear_error(
    corpus: Path,
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    device: str,
    message: str,
) -> None:
    from tests.fix_cli import one_error_line, run

    monkeypatch.setenv("CREST_HOME", str(tmp_path))
    args = ["ingest", str(corpus), "--store", "w", "--tokenizer", str(tiny_dir), "--dense-model", str(tiny_dir)]
    code, _, err = run(monkeypatch, capsys, *args, "--dense-device", device)
    assert code == 2  # ConfigError, before anything is read or built
    assert message in one_error_line(err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_a_dense_part_built_on_cuda_matches_the_cpu_build(db_dsn: str, corpus: Path, tiny_dir: Path) -> None:
    from crest.decoding.models import load_model
    from crest.ingest.dense import DenseOptions, _embed

    tokens = np.random.default_rng(0).integers(2, len(WORDS) + 2, size=700).astype(np.int64)
    offsets = np.array([0, 300, 700], dtype=np.int64)
    positions = sample_positions(offsets, count=600, seed=0, window=128)
    options = DenseOptions(str(tiny_dir), window=128, batch=3)
    states = {}
    for device in ("cpu", "cuda"):
        model = load_model(str(tiny_dir), device=device).model
        blocks = list(_embed(model, tokens, offsets, positions, options))
        assert np.concatenate([rows for rows, _ in blocks]).tolist() == list(range(positions.shape[0]))
        states[device] = np.concatenate([block for _, block in blocks])  # [S, H]
    assert np.allclose(states["cuda"], states["cpu"], atol=1e-4, rtol=1e-4)  # float32 on both (no TF32)

    def part(device: str) -> tuple[Any, list[tuple[str, list[int]]]]:
        built = ingest_dense(db_dsn, corpus, tiny_dir, device=device, precision="single")
        with psycopg.connect(db_dsn) as conn:
            meta = dense_db.read_meta(conn, built.store_id)
            rows = conn.execute(f"SELECT embedding::text, continuation FROM crest_dense_s{built.store_id}").fetchall()
        return meta, rows

    (cpu_meta, cpu_rows), (gpu_meta, gpu_rows) = part("cpu"), part("cuda")
    assert gpu_meta.figures["device"] == "cuda:0" and gpu_meta.model_fingerprint == cpu_meta.model_fingerprint
    assert [c for _, c in gpu_rows] == [c for _, c in cpu_rows]  # the same positions and continuations
    cpu_vectors = np.array([json.loads(v) for v, _ in cpu_rows])
    gpu_vectors = np.array([json.loads(v) for v, _ in gpu_rows])
    assert np.allclose(np.abs(gpu_vectors), np.abs(cpu_vectors), atol=1e-3)  # a PCA axis may flip its sign


@pytest.mark.slow  # a `crest` subprocess that loads torch and the model, 10-60 s
def test_cli_generates_with_the_dense_drafter_and_refuses_another_model(
    db_dsn: str, dense_store: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    from tests.fix_cli import one_error_line, run_cli

    args = ["generate", "w1 w2 w3 w4", "--store", "words", "--drafter", "crest+dense+prompt", "--max-new-tokens", "8"]
    done = run_cli(*args, "--model", str(tiny_dir), "--max-draft-tokens", "16", dsn=db_dsn, home=tmp_path)
    assert done.returncode == 0, done.stderr
    other = save_tiny(tmp_path / "other", seed=4)
    refused = run_cli(*args, "--model", str(other), dsn=db_dsn, home=tmp_path)
    assert refused.returncode == 2 and "dense part was built with model" in one_error_line(refused.stderr)


def test_migration_0006_goes_down_with_the_dense_tables_and_up_again(db_dsn: str, dense_store: Any) -> None:
    from importlib import resources

    from alembic import command
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from crest.db.versions import MIGRATIONS, upgrade

    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(db_dsn), poolclass=NullPool)
    config = Config()
    config.set_main_option("script_location", str(resources.files(MIGRATIONS)))
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0005")
    finally:
        engine.dispose()
    table = f"crest_dense_s{dense_store.store_id}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass(%s), to_regclass('crest_dense')", (table,)).fetchone() == (None, None)
        assert upgrade(db_dsn) == ScriptDirectory.from_config(config).get_current_head()  # through 0006, to head
        assert conn.execute("SELECT to_regclass('crest_dense') IS NOT NULL").fetchone() == (True,)
