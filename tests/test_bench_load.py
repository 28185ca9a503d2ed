"""`crest bench lookup --seconds`: several processes of threads drafting against one server give sane figures."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from crest.bench.lookup_load import bench_load
from crest.cli.app import app
from crest.errors import ConfigError
from tests.fix_store import ROWS, publish


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
def test_load_figures_are_sane(db_dsn: str, cache: bool) -> None:
    publish(db_dsn, "demo", ROWS)
    figures = bench_load(db_dsn, "demo", concurrency=3, processes=2, seconds=0.5, cache=cache)
    assert figures.errors == 0
    assert figures.lookups > 0 and figures.drafts == figures.lookups  # every context ends in a stored n-gram
    # it ran the time asked (a lower bound: a loaded machine only adds); its end is the bench's own deadline (the
    # threads stop starting lookups at it, and a process that sent nothing within seconds + 120 is an error), not
    # a bound on this machine's speed
    assert figures.seconds > 0.4
    assert figures.lookups_per_second == pytest.approx(figures.lookups / figures.seconds)
    assert 0 < figures.median_us <= figures.p99_us <= figures.max_us


def test_load_cli_json(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    args = ["bench", "lookup", "--store", "demo", "--seconds", "0.5", "--concurrency", "2", "--json"]
    done = CliRunner().invoke(app, [*args, "--dsn", db_dsn])
    assert done.exit_code == 0, done.output
    results = json.loads(done.output)
    assert results["benchmark"] == "lookup-load" and results["store"] == "demo"
    (figures,) = results["rows"]
    assert figures["errors"] == 0 and figures["lookups"] > 0 and figures["processes"] == 1


def test_load_bad_options(db_dsn: str) -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        bench_load(db_dsn, "demo", concurrency=0, seconds=1)
