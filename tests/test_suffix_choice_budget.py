"""`--suffix-rule auto --budget`: the two rules compared at equal bytes, the store filled the chosen rule's way.

Under `prune` a budget counts only the rows pruning keeps, so it reaches further down the ranks than `lookup`'s; an
`auto` build that loaded the `lookup` way and then pruned would end far under its budget. Checked against builds of
the chosen rule with the same budget (same rows), held-out and judge choices alike, and `choose_rule` reading each
rule's own rows.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crest.config import IngestOptions
from crest.decoding.tokenizer import load_tokenizer
from crest.ingest.pipeline import build_store
from crest.ingest.publishing import Vocabulary
from crest.ingest.suffix_choice import choose_rule
from tests.fix_corpus import make_word_tokenizer
from tests.fix_judged import CHOICE_WORDS, choice_options, row_of, word_corpus, word_offsets, word_phrases
from tests.fix_learning import published, version_rows

SMALL, LARGE = 100_000, 160_000  # bytes on disk; at 100 kB 210 of the 266 pruned rows fit


def _budgeted(seed: int, rule: str, budget: int) -> IngestOptions:
    return replace(choice_options(seed, rule), top_t=None, budget=budget)


def _rows(db_dsn: str, store: str) -> set[tuple[int, bytes, int, bytes]]:
    return version_rows(db_dsn, published(db_dsn, store)["static"])


# phrases half the corpus (tests/fix_judged.py); what each judge prefers at these budgets on it: the held-out slice
# prune's rows at 100 kB, longest's at 160 kB; a judge of noise words prune's, of the phrases alone longest's
@pytest.mark.parametrize(
    ("budget", "judge_share", "want"),
    [(SMALL, None, "prune"), (LARGE, None, "longest"), (SMALL, 0.0, "prune"), (SMALL, 1.0, "longest")],
    ids=["held-out-prune", "held-out-longest", "noise-judge-prune", "phrase-judge-longest"],
)
def test_auto_fills_its_budget_the_chosen_rules_way(
    db_dsn: str, tmp_path: Path, budget: int, judge_share: float | None, want: str
) -> None:
    spec = str(make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS))
    vocabulary = Vocabulary.of(load_tokenizer(spec), spec)
    rng = np.random.default_rng(0)
    phrases = word_phrases(rng)
    corpus = word_corpus(rng, phrases, 0.5, 300)
    judge = None if judge_share is None else word_corpus(np.random.default_rng(7), phrases, judge_share, 40)
    got = build_store(
        *corpus, store="auto", dsn=db_dsn, vocabulary=vocabulary, options=_budgeted(0, "auto", budget), judge=judge
    )
    choice = got.suffix_choice
    assert choice is not None and choice["rule"] == want, choice
    assert choice["judged_on"] == ("held-out" if judge is None else "judge") and got.tokens == int(corpus[1][-1])
    same = "prune" if want == "prune" else "lookup"
    build_store(*corpus, store="same", dsn=db_dsn, vocabulary=vocabulary, options=_budgeted(0, same, budget))
    rows = _rows(db_dsn, "auto")
    assert rows == _rows(db_dsn, "same")
    assert 0.85 * budget < got.table_bytes + got.index_bytes <= budget  # filled, whichever rule
    if want == "prune":  # what loading the `lookup` way and pruning afterwards would have left
        build_store(*corpus, store="lookup", dsn=db_dsn, vocabulary=vocabulary, options=_budgeted(0, "lookup", budget))
        loaded = {key for _, key, _, _ in _rows(db_dsn, "lookup")}
        assert not {key for _, key, _, _ in rows} <= loaded  # prune reached ranks the lookup budget never loads


def test_each_rule_is_judged_on_its_own_rows() -> None:
    # prune's pool keeps "1" only; `longest` reads "2 1" (followed by 11) only when its own rows hold it
    pool = [row_of([1], 10, 500), row_of([2, 1], 11, 1)]
    held = (np.array([2, 1, 11, 2, 1, 11], dtype=np.int32), word_offsets([3, 3]))
    kwargs = {"width": 2, "max_n": 4, "length": 3, "table": None, "seed": 0}
    own = choose_rule(pool, [True, False], held, longest_rows=pool, **kwargs)  # type: ignore[arg-type]
    assert own.rule == "longest" and own.m_longest > own.m_prune
    fewer = choose_rule(pool, [True, False], held, longest_rows=pool[:1], **kwargs)  # type: ignore[arg-type]
    assert fewer.rule == "prune" and fewer.m_longest == fewer.m_prune
