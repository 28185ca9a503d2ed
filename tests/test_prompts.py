"""Prompts files for `crest generate --prompts` and `crest bench generate`: accepted shapes and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from crest.errors import CorpusError
from crest.ingest.prompts import read_prompts


def test_prompts_file_shapes(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = ['{"prompt": "a"}', "", '{"turns": ["b", "later"]}', '{"text": "c"}', '{"prompt": "d", "id": 4}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert list(read_prompts(str(path))) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ('{"prompt": "a"}\n{oops}\n', r"line 2 is not valid JSON"),
        ('{"prompt": "a"}\n["a list"]\n', r'line 2 has no "prompt" string'),
        ('{"prompt": 7}\n', r'line 1 has no "prompt" string'),
        ('{"turns": []}\n', r'line 1 has no "prompt" string'),
        (b'{"prompt": "\xff"}\n', r"not valid UTF-8"),
        (None, r"cannot read"),
    ],
    ids=["bad-json", "not-an-object", "not-a-string", "no-turns", "not-utf8", "missing"],
)
def test_bad_prompts_file(tmp_path: Path, content: str | bytes | None, pattern: str) -> None:
    path = tmp_path / "p.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(CorpusError, match=pattern):
        list(read_prompts(str(path)))
