"""`crest bench vllm`'s pure parts: the workload builders, the fleet's schedule, the methods and the report."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from crest.bench.proposer_lines import ProposerTime, log_size, parse_proposer_line, wait_proposer_line
from crest.bench.serve_figures import serve_figures
from crest.bench.vllm_compare import PassRow, markdown, spread, standard_methods
from crest.bench.vllm_workloads import (
    SECOND_ASK,
    Request,
    chat_requests,
    edit_requests,
    fleet_schedule,
    same_texts,
    second_turns,
    self_corpus_lines,
    stdlib_functions,
)


def test_stdlib_functions_are_top_level_functions_of_the_asked_length(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(8))
    (tmp_path / "a.py").write_text(f"def long():\n{body}\n    return 0\n\ndef short():\n    return 1\n")
    (tmp_path / "b.py").write_text("def broken(:\n")
    found = stdlib_functions(tmp_path.glob("*.py"), count=5)
    assert found == [f"def long():\n{body}\n    return 0"]
    assert stdlib_functions(tmp_path.glob("*.py"), count=5, seed=1) == found  # seeded, and one only


def test_a_second_turn_sends_back_the_first_and_its_answer() -> None:
    first = edit_requests(["def f(x):\n    return x"])
    assert first[0].chat and "def f(x):" in first[0].messages[0][1]
    (turn,) = second_turns(first, ["def f(x: int) -> int:\n    return x"])
    assert [role for role, _ in turn.messages] == ["user", "assistant", "user"]
    assert turn.messages[1][1].startswith("def f(x: int)") and turn.messages[2][1] == SECOND_ASK
    assert not Request(prompt="def g():").chat


def test_the_fleet_serves_each_prompt_on_one_replica_then_on_the_other() -> None:
    workers = fleet_schedule(5)
    assert workers == [[(0, 0), (0, 1), (2, 0), (2, 1), (4, 0), (4, 1)], [(1, 1), (1, 0), (3, 1), (3, 0)]]
    assert fleet_schedule(1) == [[(0, 0), (0, 1)]]
    assert spread(5, 2) == [[(0, 0), (2, 0), (4, 0)], [(1, 0), (3, 0)]]


def test_methods_and_exactness() -> None:
    methods = standard_methods("stdlib")
    assert list(methods) == ["none", "ngram", "suffix", "crest+prompt-k8", "crest+prompt-k16", "prompt-k8"]
    assert methods["crest+prompt-k16"].crest and methods["crest+prompt-k16"].env["CREST_STORE"] == "stdlib"
    assert methods["crest+prompt-k8"].speculative == {
        "method": "custom_class",
        "model": "crest.integrations.vllm.CrestProposer",
        "num_speculative_tokens": 8,
    }
    assert not methods["suffix"].crest and methods["none"].speculative is None
    assert same_texts(["a", None, "c"], ["a", "b", "x"]) == 1
    assert same_texts(["a"], None) is None and same_texts(["a"], ["a", "b"]) is None


def test_the_report_has_one_table_per_workload() -> None:
    figures = serve_figures([], mode="server", drafter="suffix", concurrency=8, wall=1.0)
    own = ProposerTime(steps=40, p50_ms=0.81, p99_ms=2.5, row_ms=0.1, cpu_p50_ms=0.77)
    rows = [
        PassRow("suffix", "humaneval", "B", figures, 40.0, 30.0, 12, 2.5),
        PassRow("suffix", "fleet", "phase 1", figures, 0, 0, 3, 1.0, 4),
        PassRow("crest+prompt-k16", "fleet", "phase 1", figures, 0, 0, 3, 1.0, 4, own),
    ]
    text = markdown(rows)
    assert text.startswith("**humaneval**") and "| suffix | B | 8 |" in text and "| 30 / 40 |" in text
    assert "| 12/0 |" in text and "| 3/4 |" in text and "**fleet**" in text
    assert "| - | 12/0 |" in text and "| 0.81 / 2.50 (0.77) | 3/4 |" in text  # the proposer's own time: crest only


def test_the_proposers_own_time_is_read_from_the_line_it_says_once_a_pass_stops(tmp_path: Path) -> None:
    from crest.integrations._report import DraftReport

    log = tmp_path / "server.log"
    log.write_text("INFO an earlier pass: " + _said(DraftReport(None, every=1e9), 2.0) + "\n", encoding="utf-8")
    after = log_size(log)
    assert wait_proposer_line(log, after=after, timeout=0.2) is None  # nothing said since
    report = DraftReport(None, every=1e9)
    with log.open("a", encoding="utf-8") as sink:
        sink.write("INFO vLLM's own lines\n" + _said(report, 0.004) + "\n")
    found = wait_proposer_line(log, after=after, timeout=5)
    assert found == ProposerTime(steps=3, p50_ms=4.0, p99_ms=4.0, row_ms=2.0, cpu_p50_ms=1.0)
    assert parse_proposer_line(log.read_text(encoding="utf-8")) == found  # the last line of a whole log
    assert parse_proposer_line("no line here") is None


def _said(report: Any, seconds: float) -> str:
    """Return the line the proposer's report says after three steps of `seconds` each (two rows, a quarter CPU)."""
    for _ in range(3):
        report.verified(4, 2)
        report.step(seconds=seconds, cpu=seconds / 4, rows=2)
    line = report.say(force=True)
    assert line is not None
    return str(line)


def test_the_chat_workload_asks_first_turns_and_its_store_leaves_them_out(tmp_path: Path) -> None:
    (turn,) = chat_requests(["Compose a travel blog post."])
    assert turn.chat and turn.messages == (("user", "Compose a travel blog post."),)
    records = ["<|im_start|>user\nhello<|im_end|>\nHi!", "<|im_start|>user\nCompose a travel blog post.<|im_end|>\nOk"]
    corpus = tmp_path / "self.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as sink:
        sink.writelines(json.dumps({"text": r}) + "\n" for r in records)
    kept = list(self_corpus_lines(corpus, leave_out=["Compose a travel blog post."]))
    assert [json.loads(line)["text"] for line in kept] == records[:1] and kept[0].endswith("\n")
    assert len(list(self_corpus_lines(corpus))) == 2


def test_the_prompt_method_drafts_without_a_store() -> None:
    method = standard_methods(None)["prompt-k8"]
    assert method.crest and method.env["CREST_DRAFTER"] == "prompt" and "CREST_STORE" not in method.env
