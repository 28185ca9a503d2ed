"""Every bash and python block in README.md and docs/ runs as written, on the embedded default database.

Blocks run in file order in one sandbox per file (a private CREST_HOME, so the embedded PostgreSQL is the
default database, and a working directory holding the files the examples name: `corpus.json`, `src/`,
`questions.jsonl`). A block that cannot run here says so on the line above it with
`<!-- not run by tests: REASON -->` (installs, Docker, hour-long benchmark runs); a test checks that every
other block ran. A block tagged anything else than bash, python or a shown-only tag (text, json, sql, toml)
fails, so a `sh` or `console` block cannot skip silently. In the set-up commands the `pip install` steps are
left out: this suite runs inside that installed environment (tests/test_wheel.py installs crest from a wheel
the same way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = r"(?:<!-- not run by tests: (?P<why>[^>]*?) -->\n)?"
BLOCK = re.compile(MARK + r"^```(?P<lang>[^`\n]*)\n(?P<body>.*?)^```", re.S | re.M)  # any info string
RUN = ("bash", "python")
SHOWN = ("text", "json", "sql", "toml")  # output and data, never commands: a `sh` or `console` block would be one


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    body: str
    why: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def find_blocks(path: Path) -> list[Block]:
    """Return the fenced code blocks of a markdown file with their languages and not-run reasons."""
    text = path.read_text(encoding="utf-8")
    return [
        Block(path, text.count("\n", 0, m.start("body")), m.group("lang"), m.group("body"), m.group("why"))
        for m in BLOCK.finditer(text)
    ]


ALL = [b for path in DOCS for b in find_blocks(path)]
RUNNABLE = [b for b in ALL if b.lang in RUN and b.why is None]


def without_installs(body: str) -> str:
    """Drop the `pip install` steps of a `&&` chain (this suite runs in the installed environment)."""
    lines = []
    for line in body.splitlines():
        steps = [s for s in line.split(" && ") if "pip install" not in s]
        if steps:
            lines.append(" && ".join(steps))
    return "\n".join(lines) + "\n"


def make_sandbox(root: Path) -> None:
    """Write the files the examples name into `root`."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    src = root / "src" / "pkg"
    src.mkdir(parents=True)
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py"):
        shutil.copy(stdlib / name, src / name)
    conversations = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Write a for loop over range({i}) in Python."},
                {"from": "gpt", "value": f"for i in range({i}):\n    print(i)\n"},
            ],
        }
        for i in range(40)
    ]
    (root / "corpus.json").write_text(json.dumps(conversations))
    prompts = [{"prompt": "What is a Python list?"}, {"prompt": "Name three colours."}]
    (root / "questions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


@pytest.fixture(scope="module")
def sandboxes() -> Iterator[dict[Path, tuple[Path, dict[str, str]]]]:
    """Yield {markdown file: (working directory, environment)}; one private CREST_HOME per file."""
    made: dict[Path, tuple[Path, dict[str, str]]] = {}
    base = Path(tempfile.mkdtemp(prefix="crest-docs-"))
    for path in DOCS:
        work = base / path.stem
        work.mkdir()
        make_sandbox(work)
        env = {k: v for k, v in os.environ.items() if k not in ("CREST_DATABASE_URL", "CREST_DSN")}
        env |= {"CREST_HOME": str(work / ".crest-home"), "COLUMNS": "100", "CREST_MAX_NEW_TOKENS": "24"}
        made[path] = (work, env)
    yield made
    for _work, env in made.values():
        subprocess.run([sys.executable, "-m", "crest.cli", "server", "stop"], env=env, capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def test_every_block_runs_or_says_why_not() -> None:
    """A bash or python block either runs in this suite or names the reason it does not."""
    assert RUNNABLE, "no runnable blocks found: the block pattern is broken"
    for block in ALL:
        assert block.lang in RUN + SHOWN, (
            f"{block.id}: a block tagged {block.lang!r} would never run; tag it one of {RUN} (run by this test) "
            f"or {SHOWN} (shown only)"
        )
        if block.lang in RUN and block.why is not None:
            assert block.why.strip(), f"{block.id}: a not-run marker needs a reason"
    readme = [b for b in RUNNABLE if b.path.name == "README.md"]
    assert len(readme) >= 4, [b.id for b in readme]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_as_written(block: Block, sandboxes: dict[Path, tuple[Path, dict[str, str]]]) -> None:
    """The block exits 0 in the sandbox of its file, after the blocks before it."""
    work, env = sandboxes[block.path]
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", without_installs(block.body)]
    else:
        script = work / f"block_{block.line}.py"
        script.write_text(block.body)
        cmd = [sys.executable, str(script)]
    # within the test's 600 s (pytest-timeout counts the test function only)
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if re.search(r"\bcrest lookup\b", block.body):  # it exits 0 on a miss too: the docs promise a match
        missed = "matched suffix" not in done.stdout or "no stored suffix matches" in done.stdout
        assert not missed, f"{block.id}: a lookup missed\n{done.stdout[-2000:]}"
        shown = " ".join(done.stdout.split())
        for said in promised_suffixes(block.body):
            assert said in shown, f"{block.id}: the docs say {said!r}, the lookup printed\n{done.stdout[-2000:]}"


PROMISED = re.compile(r"\bcrest lookup\b[^\n#]*#.*?(matched suffix .*? \(\d+ token)")


def promised_suffixes(body: str) -> list[str]:
    """Return what a block's `crest lookup ... # matched suffix 'a' 'b' (2 tokens)` comments say it prints."""
    return [m.group(1) for m in PROMISED.finditer(body)]


def test_the_readme_says_which_suffix_its_lookup_matches() -> None:
    """The README's lookup example names the suffix it matches, so the run above checks the rule's choice."""
    said = [s for b in RUNNABLE if b.path.name == "README.md" for s in promised_suffixes(b.body)]
    assert said == ["matched suffix 'self' '):' (2 token"], said
