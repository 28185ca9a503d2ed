"""Where commands write and listen: result files replaced whole through links and never over a FIFO, device or
directory (`crest._outputs`, `crest export`, `crest answer`), `rest-index build --out` directories, and
`crest serve` refusing an address in use before its model loads. Bad input is one `Error:` line and exit 2.

No test writes to a real device: a FIFO made in tmp_path stands for one (a rename would swap either for a file).
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crest._outputs import output_file, replacing
from crest.errors import ConfigError
from crest.serving.server import check_listen
from tests.fix_cli import one_error_line, run
from tests.fix_store import ROWS, publish

pytest_plugins = ["tests.fix_corpus"]

Make = Callable[[Path], Path]

# ---- crest._outputs ----------------------------------------------------------------------------------------------


def _fifo(root: Path) -> Path:
    os.mkfifo(root / "pipe")
    return root / "pipe"


def _directory(root: Path) -> Path:
    (root / "dir").mkdir()
    return root / "dir"


def _link_to_fifo(root: Path) -> Path:
    (root / "link").symlink_to(_fifo(root))
    return root / "link"


def _link_loop(root: Path) -> Path:
    (root / "loop").symlink_to(root / "loop")
    return root / "loop"


REFUSED = [
    pytest.param(_fifo, "is not a regular file", id="fifo"),
    pytest.param(_link_to_fifo, "is not a regular file", id="link-to-a-fifo"),
    pytest.param(_directory, "is a directory", id="directory"),
    pytest.param(_link_loop, "cannot follow its links", id="link-loop"),
]


@pytest.mark.parametrize(("make", "message"), REFUSED)
def test_output_file_refuses_what_is_not_a_regular_file(tmp_path: Path, make: Make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        output_file(path, option="OUT")


def test_output_file_follows_links_to_the_real_path(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "real")  # dangling: the file it names is written
    assert output_file(tmp_path / "link", option="OUT") == (tmp_path / "sub" / "real").resolve()


def test_replacing_writes_the_target_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with replacing(target) as sink:
        sink.write(b"new")
        assert target.read_bytes() == b"old"  # a reader sees the old file until the block ends
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failed_block_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyError), replacing(target) as sink:
        sink.write(b"half")
        raise KeyError("stopped")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failed_block_keeps_its_partial_file(tmp_path: Path) -> None:
    target, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    with pytest.raises(KeyError), replacing(target, partial=partial) as sink:
        sink.write(b"done so far\n")
        raise KeyError("stopped")
    assert partial.read_bytes() == b"done so far\n" and not target.exists()


def test_replacing_in_a_directory_that_cannot_be_written_is_refused_before_the_block(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    ran = False
    with pytest.raises(ConfigError, match=r"cannot write .*: Not a directory"), replacing(tmp_path / "file" / "x"):
        ran = True
    assert not ran


# ---- crest export ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), REFUSED)
def test_export_refuses_a_target_that_is_not_a_regular_file(
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Make,
    message: str,
) -> None:
    publish(db_dsn, "outs", ROWS)
    path = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run(monkeypatch, capsys, "export", str(path), "-s", "outs", "--dsn", db_dsn)
    assert code == 2 and message in one_error_line(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing replaced, no temporary file left
    if (tmp_path / "pipe").exists():
        assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)


def test_export_writes_through_a_link_into_its_real_directory(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(db_dsn, "outs", ROWS)
    (tmp_path / "real").mkdir()
    (tmp_path / "link.lookup").symlink_to(tmp_path / "real" / "x.lookup")  # dangling until the export
    code, _, err = run(monkeypatch, capsys, "export", str(tmp_path / "link.lookup"), "-s", "outs", "--dsn", db_dsn)
    assert code == 0, err
    assert (tmp_path / "link.lookup").is_symlink() and (tmp_path / "real" / "x.lookup").stat().st_size > 0
    assert [p.name for p in (tmp_path / "real").iterdir()] == ["x.lookup"]  # the temporary file was beside it


def test_answer_refuses_a_link_loop_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = _link_loop(tmp_path)
    args = ["answer", "--prompts", "humaneval", "--limit", "1", "--model", str(tmp_path / "no-model")]
    code, _, err = run(monkeypatch, capsys, *args, "--out", str(loop))
    assert code == 2 and "cannot follow its links" in one_error_line(err), err


def _partial_fifo(root: Path) -> None:
    os.mkfifo(root / "out.jsonl.partial")


def _partial_directory(root: Path) -> None:
    (root / "out.jsonl.partial").mkdir()


def _partial_link(root: Path) -> None:
    (root / "elsewhere.jsonl").write_text("precious\n")
    (root / "out.jsonl.partial").symlink_to(root / "elsewhere.jsonl")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_partial_fifo, id="fifo"),  # opening it to append would wait for a reader forever
        pytest.param(_partial_directory, id="directory"),
        pytest.param(_partial_link, id="link"),  # the rename would turn OUT into the link
    ],
)  # fmt: skip
def test_answer_refuses_a_partial_file_that_is_not_a_regular_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make: Callable[[Path], None]
) -> None:
    make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["answer", "--prompts", "humaneval", "--limit", "1", "--model", str(tmp_path / "no-model")]
    code, _, err = run(monkeypatch, capsys, *args, "--out", str(tmp_path / "out.jsonl"))
    assert code == 2 and "out.jsonl.partial' is not a regular file" in one_error_line(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- crest rest-index build --out --------------------------------------------------------------------------------


def _index_args(tmp_path: Path, tokenizer: Path, out: str) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nthe cat sat on the hat\n")
    return ["rest-index", "build", str(corpus), "--out", out, "--tokenizer", str(tokenizer)]


@pytest.mark.parametrize(
    ("given", "others", "message"),
    [
        pytest.param("", [], r"--out is empty", id="empty"),
        pytest.param("  ", [], r"--out is empty", id="blank"),
        pytest.param("corpus.txt/index", [], r"cannot create --out .*: Not a directory", id="under-a-file"),
        pytest.param("index", ["notes.txt"], r"holds other files than an index", id="holds-other-files"),
        pytest.param("index", ["meta.json", "notes.txt"], r"holds other files than an index", id="index-and-others"),
        pytest.param("index", ["sa.npy"], r"holds other files than an index", id="index-without-meta"),
    ],
)  # fmt: skip
def test_rest_index_build_refuses_an_out_it_cannot_or_should_not_write(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    word_tokenizer_dir: Path,
    given: str,
    others: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    args = _index_args(tmp_path, word_tokenizer_dir, given)
    if others:
        (tmp_path / "index").mkdir()
        for name in others:
            (tmp_path / "index" / name).write_text("precious")
    code, stdout, err = run(monkeypatch, capsys, *args)
    assert code == 2 and stdout == "", err
    assert re.search(message, one_error_line(err)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["corpus.txt", "index"] if others else ["corpus.txt"])
    if others:
        assert all((tmp_path / "index" / name).read_text() == "precious" for name in others)


def test_rest_index_build_replaces_an_existing_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], word_tokenizer_dir: Path
) -> None:
    out = tmp_path / "index"
    for _ in range(2):  # the second build finds the first one's index there
        code, _, err = run(monkeypatch, capsys, *_index_args(tmp_path, word_tokenizer_dir, str(out)))
        assert code == 0, err
    assert "meta.json" in {p.name for p in out.iterdir()}


def _index_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_rest_index_build_that_fails_while_writing_leaves_the_old_index_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], word_tokenizer_dir: Path
) -> None:
    from crest.drafters.suffix_array import RestIndex

    out = tmp_path / "index"
    args = _index_args(tmp_path, word_tokenizer_dir, str(out))
    assert run(monkeypatch, capsys, *args)[0] == 0
    before = _index_files(out)
    (tmp_path / "corpus.txt").write_text("a different corpus of other words\n")

    def half_save(self: RestIndex, path: Path | str) -> None:  # a full disk after the first array
        (Path(path) / "tokens.npy").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RestIndex, "save", half_save)
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2 and "No space left on device" in one_error_line(err), err
    assert _index_files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "index"]  # no partial directory beside it
    RestIndex.load(out)


def test_rest_index_build_replaces_an_index_through_a_link_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], word_tokenizer_dir: Path
) -> None:
    from crest.drafters.suffix_array import RestIndex

    real = tmp_path / "real"
    link = tmp_path / "link"
    args = _index_args(tmp_path, word_tokenizer_dir, str(real))
    assert run(monkeypatch, capsys, *args)[0] == 0
    first = len(RestIndex.load(real))
    real.chmod(0o755)
    link.symlink_to(real, target_is_directory=True)
    again = _index_args(tmp_path, word_tokenizer_dir, str(link))
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat\n" * 5)
    code, _, err = run(monkeypatch, capsys, *again)
    assert code == 0, err
    assert link.is_symlink() and stat.S_IMODE(real.stat().st_mode) == 0o755
    assert len(RestIndex.load(link)) == len(RestIndex.load(real)) != first  # the second corpus's index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "link", "real"]


# ---- crest serve --port ------------------------------------------------------------------------------------------


def _listening(family: socket.AddressFamily, host: str) -> socket.socket:
    busy = socket.socket(family)  # listening, as another server on the port would be
    busy.bind((host, 0))
    busy.listen()
    return busy


def _has_ipv6_loopback() -> bool:
    try:
        _listening(socket.AF_INET6, "::1").close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("family", "host", "shown"),
    [
        pytest.param(socket.AF_INET, "127.0.0.1", "127.0.0.1:{port}", id="ipv4"),
        pytest.param(
            socket.AF_INET6, "::1", "[::1]:{port}", id="ipv6",
            marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)  # fmt: skip
def test_serve_refuses_a_port_in_use_before_the_model_loads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    family: socket.AddressFamily,
    host: str,
    shown: str,
) -> None:
    with _listening(family, host) as busy:
        port = busy.getsockname()[1]
        args = ["serve", "--host", host, "--port", str(port), "--drafter", "prompt", "--model", str(tmp_path / "none")]
        started = time.monotonic()
        code, _, err = run(monkeypatch, capsys, *args)
    line = one_error_line(err)  # the port, not the missing model: the address is checked first
    assert code == 2 and line == f"Error: cannot listen on {shown.format(port=port)}: Address already in use", err
    assert time.monotonic() - started < 30


def test_check_listen_accepts_a_free_port_and_lets_it_go() -> None:
    with _listening(socket.AF_INET, "127.0.0.1") as probe:
        port = probe.getsockname()[1]
    check_listen("127.0.0.1", port)
    check_listen("127.0.0.1", port)  # the first check holds nothing: the server binds it next


@pytest.mark.parametrize(
    ("host", "message"),
    [
        pytest.param("no-such-host.invalid", r"cannot listen on no-such-host\.invalid:\d+: ", id="unresolvable"),
        pytest.param("\udcffhost", r"cannot listen on .*host:\d+: ", id="not-encodable"),
    ],
)
def test_check_listen_names_a_host_it_cannot_bind(host: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_listen(host, 8000)
