"""`crest bench accept`'s dense rows on the tiny model (tests/fix_dense): dense datastores at two sizes beside REST
and crest, the hybrids on the crest store, their bytes (dense table + index; a hybrid's both parts), M fed by the
hidden states, greedy outputs exact in the real loop, the dense-vs-REST comparison, and the options' checks."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from crest.bench.accept import AcceptOptions, run_accept
from crest.bench.accept_dense import auto_positions, hybrids
from crest.bench.datastores import Variant
from crest.errors import ConfigError
from tests.fix_corpus import write_jsonl
from tests.fix_dense import PROMPTS

pytest_plugins = ["tests.fix_dense"]


def test_bench_accept_measures_dense_and_hybrid_rows(db_dsn: str, corpus: Path, tiny_dir: Path, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    opts = AcceptOptions(
        corpus=(str(corpus),),
        prompts=str(prompts),
        drafters=("none", "rest", "crest", "crest+prompt", "dense", "crest+dense", "crest+dense+prompt"),
        percents=(50.0, 100.0),
        top_t=(5, 40),
        max_n=2,
        max_new_tokens=20,
        timing="largest",
        check=2,
        dense_positions=(30, 10_000),
        dense_dims=16,
        dense_continuation=8,
        dense_precision="single",
    )
    out = tmp_path / "out"
    run_accept(opts, model=str(tiny_dir), dsn=db_dsn, out=out, argv=["crest", "bench", "accept"])
    saved = json.loads((out / "accept.json").read_text())
    rows = saved["rows"]
    dense = sorted((r for r in rows if r["drafter"] == "dense"), key=lambda r: r["positions"])
    assert [r["positions"] for r in dense] == [30, dense[1]["positions"]] and dense[1]["positions"] > 30
    assert 0 < dense[0]["bytes"] < dense[1]["bytes"]  # the dense table + its HNSW index grow with the positions
    assert dense[1]["mean_accepted_length"] > 2.0  # the corpus holds the model's own continuations
    assert dense[1]["mean_accepted_length"] > dense[0]["mean_accepted_length"]
    crest = {r["top_t"]: r for r in rows if r["drafter"] == "crest"}
    for name in ("crest+dense", "crest+dense+prompt"):
        hybrid = sorted((r for r in rows if r["drafter"] == name), key=lambda r: r["positions"])
        assert len(hybrid) == 2 and all(r["top_t"] == 40 for r in hybrid)  # the largest crest store by default
        assert [r["bytes"] for r in hybrid] == [crest[40]["bytes"] + d["bytes"] for d in dense]
        assert all(r["mean_accepted_length"] >= 1.0 for r in hybrid)
    timed = [r for r in rows if r["drafter"] in ("dense", "crest+dense+prompt") and r["real"] is not None]
    assert timed and all(r["real"]["exact"] == 3 for r in timed)  # greedy output equals plain decoding
    checks = [c for c in saved["crosscheck"] if c["drafter"].endswith("dense") or "dense+" in c["drafter"]]
    assert len(checks) == 2 * 3 and all(c["same_output"] for c in checks)
    assert {d["kind"] for d in saved["datastores"]} == {"rest", "crest", "dense", "hybrid"}
    assert set(saved["dense_comparison"]) == {"equal_storage", "above_everywhere"}
    assert "p=30" in (out / "accept.md").read_text()
    assert (out / "accept_custom.png").stat().st_size > 1000
    with psycopg.connect(db_dsn) as conn:  # the dense parts were built with the asked precision, not the default
        kinds = conn.execute(
            "SELECT DISTINCT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid::regclass::text LIKE 'crest_dense_s%' AND attname = 'embedding'"
        ).fetchall()
    assert kinds == [("vector(16)",)]


def test_dense_sizes_follow_rest_bytes_and_hybrids_take_the_named_store() -> None:
    rest = [Variant(kind="rest", name=f"r{i}", nbytes=b) for i, b in enumerate((183_000, 27_400_000))]
    assert auto_positions(rest) == [180, 27_000]  # about 1 kB a dense row: comparable bytes
    crest = [Variant(kind="crest", name=f"c{t}", nbytes=10 * t, top_t=t) for t in (5, 40)]
    dense = [Variant(kind="dense", name="d", nbytes=7, positions=3, dense_store="d")]
    (pair,) = hybrids(crest, dense, top_t=5)
    assert (pair.store, pair.dense_store, pair.nbytes, pair.positions) == ("c5", "d", 57, 3)
    with pytest.raises(ConfigError, match="--dense-top-t"):
        hybrids(crest, dense, top_t=7)


def test_dense_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--dense-positions"):
        AcceptOptions(setting="code", dense_positions=(0,)).validate()
    with pytest.raises(ConfigError, match="--dense-continuation"):
        AcceptOptions(setting="code", dense_continuation=1).validate()
    with pytest.raises(ConfigError, match="--dense-top-t"):
        AcceptOptions(setting="code", top_t=(5, 40), dense_top_t=7).validate()
    with pytest.raises(ConfigError, match="--dense-precision"):
        AcceptOptions(setting="code", dense_precision="double").validate()


def test_cli_rejects_bad_dense_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import sys

    from crest.cli.app import main

    argv = ["crest", "bench", "accept", "--out", str(tmp_path), "--setting", "code", "--dense-positions", "10,0"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2  # ConfigError, before any datastore is built
    assert "--dense-positions" in capsys.readouterr().err
