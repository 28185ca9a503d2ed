"""`crest answer --engine vllm` (`crest.integrations.vllm_answers`): responses cut as the transformers path cuts
them, the model handed to vLLM as a Hugging Face directory, a clear error where vLLM is missing (fast), and a real
vLLM writing the corpus transformers writes for the same prompts (slow, in vLLM's Python: CREST_VLLM_PYTHON).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from crest.integrations.vllm_answers import cut, hf_directory
from tests.fix_cli import one_error_line, run
from tests.fix_vllm import required_vllm_python

pytest_plugins = ["tests.fix_dense"]

EOS = {2, 9}
ASKED = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\n\ndef load_config(path):\n",
    "The three primary colours are",
]
TIE = 0.01  # a top-2 logit gap below this is a near tie that float32 kernels may break either way


def parting_gap(loaded: Any, prompt: str, ours: str, theirs: str) -> float:
    """Return the model's top-2 logit gap at the token where two greedy answers to `prompt` part (0.0: equal)."""
    import torch

    if ours == theirs:
        return 0.0
    answer = loaded.encode_prompt(ours)
    kept = 0  # our answer's tokens whose text both answers share
    while kept < len(answer) and theirs.startswith(loaded.tokenizer.decode(answer[: kept + 1])):
        kept += 1
    with torch.no_grad():
        logits = loaded.model(torch.tensor([loaded.encode_prompt(prompt) + answer[:kept]])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize(
    ("tokens", "kept"),
    [
        pytest.param([5, 6, 2, 7, 8], [5, 6, 2], id="eos-inside"),
        pytest.param([5, 6, 9], [5, 6, 9], id="eos-last"),
        pytest.param([5, 6, 7], [5, 6, 7], id="length-cut"),
        pytest.param([2], [2], id="eos-only"),
        pytest.param([], [], id="empty"),
    ],
)
def test_a_response_ends_with_its_first_end_of_sequence_token(tokens: list[int], kept: list[int]) -> None:
    assert cut(tokens, EOS) == kept


def test_a_model_directory_is_handed_over_as_it_is(loaded: Any, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with hf_directory(loaded, str(tmp_path)) as directory:
        assert directory == tmp_path


def test_another_model_is_written_to_a_directory_that_goes_afterwards(loaded: Any, tmp_path: Path) -> None:
    from transformers import AutoConfig

    with hf_directory(loaded, "smollm2") as directory:
        names = {p.name for p in directory.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names
        config = AutoConfig.from_pretrained(str(directory))
        assert not hasattr(config, "quantization_config")
        assert config.vocab_size == loaded.model.config.vocab_size
    assert not directory.exists()


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        pytest.param("tensorrt", "unknown --engine 'tensorrt': use transformers or vllm", id="unknown"),
        pytest.param(
            "vllm", "--engine vllm needs vLLM in this Python environment", id="vllm-missing",
            marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here"),
        ),
    ],
)  # fmt: skip
def test_an_engine_that_cannot_run_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], engine: str, message: str
) -> None:
    args = ["answer", "--prompts", "humaneval", "--limit", "1", "--model", str(tmp_path / "no-model")]
    code, _, err = run(monkeypatch, capsys, *args, "--engine", engine, "--out", str(tmp_path / "out.jsonl"))
    assert code == 2 and message in one_error_line(err), err
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.slow  # vLLM starts (about 2 minutes on 2 cores) and answers three prompts, within the test's 600 s
def test_vllm_writes_the_corpus_transformers_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from crest.decoding.export import export_hf

    python = required_vllm_python()
    model = export_hf("smollm2", tmp_path / "smollm2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ASKED), encoding="utf-8")
    args = ["answer", "--prompts", str(prompts), "--max-new-tokens", "24", "--model", str(model), "--answers-only"]
    code, _, err = run(monkeypatch, capsys, *args, "--out", str(tmp_path / "hf.jsonl"))
    assert code == 0, err
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    done = subprocess.run(
        [python, "-m", "crest.cli", *args, "--engine", "vllm", "--batch", "2", "--out", str(tmp_path / "v.jsonl")],
        capture_output=True,
        text=True,
        env=env,
        timeout=480,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf, vl = (
        [json.loads(line)["text"] for line in (tmp_path / name).read_text(encoding="utf-8").splitlines()]
        for name in ("hf.jsonl", "v.jsonl")
    )
    assert len(hf) == len(vl) == 3 and all(hf)
    # vLLM's float32 kernels could break a near tie the other way on another CPU (all agree on the 2-core dev
    # machine): answers agree whole, or part where the model's top two logits (transformers') all but tie
    from crest.decoding.models import load_model

    loaded = load_model(str(model))
    gaps = [parting_gap(loaded, p, a, b) for p, a, b in zip(ASKED, hf, vl, strict=True)]
    assert all(gap < TIE for gap in gaps), (gaps, hf, vl)
