"""`crest export-hf` (crest.decoding.export): a model crest loads, written as a Hugging Face directory that loads
back with the same weights and tokenizer, no quantization config; refused targets and dtypes say why."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from crest.cli.app import app, main
from crest.decoding.export import export_hf
from crest.errors import ConfigError
from tests.fix_models import tiny_model

pytest_plugins = ["tests.fix_corpus"]


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture
def tiny_dir(tmp_path: Path, smollm2_tokenizer: Any) -> Path:
    """A tiny random llama over the SmolLM2 vocabulary, saved with the SmolLM2 tokenizer."""
    directory = tmp_path / "tiny"
    tiny_model("llama", vocab=len(smollm2_tokenizer.hf)).save_pretrained(str(directory))
    smollm2_tokenizer.hf.save_pretrained(str(directory))
    return directory


def test_export_tiny_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["export-hf", str(out), "--model", str(tiny_dir)])
    assert done.exit_code == 0, done.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    before = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    after = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert after.dtype == torch.float32
    ids = AutoTokenizer.from_pretrained(str(out)).encode("def add(a, b):", add_special_tokens=False)
    assert ids == AutoTokenizer.from_pretrained(str(tiny_dir)).encode("def add(a, b):", add_special_tokens=False)
    torch.testing.assert_close(_logits(after, ids), _logits(before, ids))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_writes_files_as_any_file_is_written(tiny_dir: Path, tmp_path: Path, umask: int) -> None:
    """Every file is 0666 less the umask (not the 0600 of a temporary file): vLLM may run as another user."""
    before = os.umask(umask)
    try:
        out = export_hf(str(tiny_dir), tmp_path / "out")
    finally:
        os.umask(before)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_export_refuses_a_full_directory_and_bad_dtype(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as done:
        main(["export-hf", str(full), "--model", str(tiny_dir)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "not empty" in err and "Traceback" not in err
    assert (full / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="dtype"):
        export_hf(str(tiny_dir), tmp_path / "new", dtype="int8")
    with pytest.raises(ConfigError, match="is a file"):
        export_hf(str(tiny_dir), full / "keep.txt")
    assert export_hf(str(tiny_dir), full, overwrite=True) == full and (full / "config.json").is_file()


@pytest.mark.slow
def test_export_smollm2_matches_crest(smollm2_model: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_hf("smollm2", tmp_path / "smollm2")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype" if "torch_dtype" in config else "dtype"]
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = smollm2_model.encode_prompt("def fibonacci(n):")
    logits = _logits(exported, ids)
    torch.testing.assert_close(logits, _logits(smollm2_model.model, ids))
    assert int(logits[-1].argmax()) == int(_logits(smollm2_model.model, ids)[-1].argmax())
