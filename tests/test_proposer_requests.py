"""`crest bench proposer`'s requests (crest.bench.proposer_requests): files, chat texts and `crest answer` lines, and
clear errors for inputs it cannot read."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from crest.bench.proposer_requests import (
    assistant_header,
    chat_requests,
    chat_texts,
    completion_requests,
    jsonl_lines,
    load_requests,
)
from crest.errors import ConfigError


class Chars:
    """A tokenizer of one token per character (its code point)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_chat_requests_split_each_text_after_its_last_assistant_header(tmp_path: Path) -> None:
    header = "<|im_start|>assistant\n"
    texts = [f"<|im_start|>user\nhi<|im_end|>\n{header}hello there<|im_end|>", "no header here", f"q\n{header}"]
    corpus = tmp_path / "self.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as sink:
        sink.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    found = chat_requests(chat_texts(str(corpus)), encode, header, limit=5, output_tokens=5)
    assert found == [(encode(f"<|im_start|>user\nhi<|im_end|>\n{header}"), encode("hello"))]  # none without an answer
    assert chat_requests(texts * 3, encode, header, limit=2, output_tokens=64)[1][1] == encode("hello there<|im_end|>")


def test_the_assistant_header_is_what_the_template_adds_for_the_answer() -> None:
    class Template:
        def apply_chat_template(
            self, turns: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
        ) -> str:
            text = "".join(f"<{t['role']}>{t['content']}</>" for t in turns)
            return text + ("<assistant>" if add_generation_prompt else "")

    assert assistant_header(Template()) == "<assistant>"


def test_completion_requests_split_each_answer_line_at_its_prompt(tmp_path: Path) -> None:
    lines = [
        {"text": "def f():\n    return 1", "prompt": "def f():\n"},
        {"text": "no prompt"},
        {"text": "other text", "prompt": "mismatch"},
        {"text": "only the prompt", "prompt": "only the prompt"},
        {"text": "ab cd", "prompt": "ab "},
    ]
    found = completion_requests(lines, encode, limit=5, output_tokens=4)
    assert found == [(encode("def f():\n"), encode("    ")), (encode("ab "), encode("cd"))]
    assert completion_requests(lines, encode, limit=1, output_tokens=64) == [
        (encode("def f():\n"), encode("    return 1"))
    ]


def test_load_requests_reads_answer_lines_gzipped_or_not(tmp_path: Path) -> None:
    lines = [{"text": "prompt answer", "prompt": "prompt "}] * 3
    plain = tmp_path / "answers.jsonl"
    plain.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n", encoding="utf-8")
    zipped = tmp_path / "answers.jsonl.gz"
    with gzip.open(zipped, "wt", encoding="utf-8") as sink:
        sink.writelines(json.dumps(x) + "\n" for x in lines)
    for path in (plain, zipped):
        assert load_requests(str(path), Chars(), limit=2) == [(encode("prompt "), encode("answer"))] * 2
    assert list(jsonl_lines(str(plain)))[0] == lines[0]


def test_load_requests_cuts_files_into_prompt_and_output(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("abcdefgh", encoding="utf-8")
    (tmp_path / "b.py").write_text("abc", encoding="utf-8")  # too short
    found = load_requests(str(tmp_path / "*.py"), Chars(), prompt_tokens=3, output_tokens=4)
    assert found == [(encode("abc"), encode("defg"))]


@pytest.mark.parametrize(
    ("name", "content", "chat", "message"),
    [
        ("missing.jsonl", None, False, "cannot read"),
        ("bad.jsonl", "{not json\n", False, "cannot read"),
        ("bad.jsonl.gz", "not gzip", False, "cannot read"),
        ("empty.jsonl", json.dumps({"text": "no prompt"}) + "\n", False, "holds no"),
        ("chat.jsonl", json.dumps({"text": "no header"}) + "\n", True, "holds no chat text"),
        ("texts.txt", "x", True, "--chat needs --inputs FILE.jsonl"),
        ("*.none", None, False, "no file of"),
    ],
    ids=["missing", "malformed-json", "not-gzip", "no-prompt", "chat-no-header", "chat-not-jsonl", "no-files"],
)
def test_load_requests_says_what_it_cannot_read(
    tmp_path: Path, name: str, content: str | None, chat: bool, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")

    class Template(Chars):
        def apply_chat_template(
            self, turns: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
        ) -> str:
            return "".join(t["content"] for t in turns) + ("<a>" if add_generation_prompt else "")

    with pytest.raises(ConfigError, match=message):
        load_requests(str(path), Template(), chat=chat, prompt_tokens=3, output_tokens=4)
