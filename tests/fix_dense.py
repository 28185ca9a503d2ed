"""A dense part for the tests: a word tokenizer and a tiny random llama over it (`tiny_dir`, `loaded`), a corpus of
the model's own greedy continuations (`corpus`) and a store `words` ingested from it with a dense part
(`dense_store`, on the per-test database), and the column type of a dense table (`column_type`). Load with
`pytest_plugins = ["tests.fix_dense"]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from crest.config import IngestOptions
from crest.decoding.generator import SpeculativeGenerator
from crest.ingest.dense import DenseOptions
from crest.ingest.pipeline import ingest
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_models import tiny_model

WORDS = [f"w{i}" for i in range(30)]
PROMPTS = ["w1 w2 w3 w4", "w5 w6 w7", "w0 w0 w8 w9 w10", "w11 w3 w12", "w13 w14", "w15 w16 w17 w18"]
OPTIONS = IngestOptions(max_n=3, top_t=1000, continuation_length=6)
DENSE_DRAFTERS = ("dense", "crest+dense", "crest+dense+prompt")


def save_tiny(directory: Path, *, seed: int) -> Path:
    """Write a word tokenizer and a tiny random llama over its vocabulary ([EOS] = 1) to `directory`."""
    make_word_tokenizer(directory, WORDS)
    model = tiny_model("llama", seed=seed, vocab=len(WORDS) + 2, max_positions=512)
    model.config.eos_token_id = 1  # [EOS]
    model.generation_config.eos_token_id = 1
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word tokenizer and a tiny random llama over its vocabulary."""
    return save_tiny(tmp_path_factory.mktemp("tiny-dense"), seed=3)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> Any:
    from crest.decoding.models import load_model

    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def corpus(tiny_dir: Path, loaded: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents of the tiny model's own greedy continuations (DReSD's best datastore: the model's outputs)."""
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, adaptive=False)
    texts = []
    for prompt in PROMPTS:
        ids = loaded.tokenizer(prompt)["input_ids"]
        out = gen.generate(ids, max_new_tokens=40).output_token_ids
        texts.append(loaded.tokenizer.decode(ids + out, skip_special_tokens=True))
    path = tmp_path_factory.mktemp("dense-corpus") / "corpus.jsonl"
    return write_jsonl(path, [{"text": t} for t in texts])


def dense_engine(
    loaded: Any, dsn: str, *, drafter: str = "dense", learning: Any = None, retry_interval: float = 5.0
) -> Any:
    """Return an Engine on store `words` (no thread, no HTTP: tests step its scheduler), drafting with `drafter`."""
    from crest.decoding.tokenizer import Tokenizer
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler
    from tests.fix_serving import flat_cost

    sched = Scheduler(loaded.model, loaded.tokenizer, cost=flat_cost(), max_batch=8)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint
    return Engine(
        sched, loaded.tokenizer, model_name="tiny", store="words", drafter=drafter, dsn=dsn, fingerprint=fingerprint,
        retry_interval=retry_interval, learning=learning,
    )  # fmt: skip


def ingest_dense(dsn: str, corpus: Path, tiny_dir: Path, **dense: Any) -> Any:
    """Ingest the corpus as store `words` with a 16-dimension dense part of the tiny model; return the build."""
    options = DenseOptions(str(tiny_dir), dims=16, positions=dense.pop("positions", 10_000), continuation=8, **dense)
    return ingest([str(corpus)], store="words", tokenizer=str(tiny_dir), dsn=dsn, options=OPTIONS, dense=options)


def column_type(dsn: str, store_id: int) -> str:
    """Return the type of a version's dense table's embedding column, such as halfvec(16)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = to_regclass(%s) AND attname = 'embedding'",
            (f"crest_dense_s{int(store_id)}",),
        ).fetchone()
    assert row is not None, f"version {store_id} has no dense table"
    return str(row[0])


@pytest.fixture
def dense_store(db_dsn: str, corpus: Path, tiny_dir: Path) -> Any:
    return ingest_dense(db_dsn, corpus, tiny_dir)
