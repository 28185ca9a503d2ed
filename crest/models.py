"""Loading target models: a Hugging Face directory or local name, or a `.gguf` file, on CPU or CUDA.

Only families whose attention accepts a 4-D mask and explicit position ids are accepted (see
`crest.verify.SUPPORTED`); anything else is refused with a clear error before any generation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crest.config import resolve_model_spec
from crest.errors import ModelError
from crest.verify import check_supported

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": None}


@dataclass
class LoadedModel:
    """A model with its tokenizer, ready for `SpeculativeGenerator`."""

    model: Any
    tokenizer: Any
    spec: str

    def encode_prompt(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Return the prompt's token ids, through the chat template when `chat`."""
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=False)]


def load_model(spec: str, *, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a causal LM and its tokenizer (no downloads) and check the verifier supports it."""
    from crest.tokenize import load_tokenizer

    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but no CUDA device is available")
    path_spec = resolve_model_spec(spec)
    tokenizer = load_tokenizer(path_spec).hf
    path = Path(path_spec).expanduser()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]} if DTYPES[dtype] is not None else {}
        try:
            if path.suffix == ".gguf":
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
            elif path.exists():
                model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(path_spec, local_files_only=True, **kwargs)
        except Exception as exc:
            raise ModelError(f"cannot load model {spec!r}: {str(exc).splitlines()[0][:300]}") from None
    check_supported(model)
    return LoadedModel(model.to(device).eval(), tokenizer, spec)  # type: ignore[arg-type]
