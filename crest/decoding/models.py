"""Loading target models: a Hugging Face directory or local name, or a `.gguf` file, on CPU or CUDA.

Only families whose attention accepts a 4-D mask and explicit position ids are accepted (see
`SUPPORTED`), with an attention kernel that honours a custom mask (sdpa or eager); anything
else is refused with a ModelError, from the config before any weights are read when possible. Nothing
is downloaded: names must already be in the local Hugging Face cache. A chat-template helper turns a
user message into prompt token ids.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crest.config import resolve_model_spec
from crest.errors import ModelError

DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "auto": None,
}


# transformers 5 renamed forward's `past_key_values` to `cache` and warns on every call that passes the old name,
# the one every transformers crest supports (>= 4.45) takes: silence that one message, for every model call crest makes
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)

SUPPORTED = ("llama", "qwen2", "mistral")  # tested: llama (SmolLM2 and tiny), qwen2 and mistral (tiny)
ATTENTION = ("sdpa", "eager")  # attention kernels that honour a custom 4-D additive mask


def check_supported(model: Any) -> None:
    """Raise ModelError unless the model's family and attention kernel accept a 4-D mask and position ids."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise ModelError(
            f"model type {kind!r} is not supported by the tree verifier (supported: {', '.join(SUPPORTED)}; "
            "tested: llama incl. SmolLM2, qwen2, mistral)"
        )
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ATTENTION:
        raise ModelError(
            f"attention implementation {attention!r} ignores custom tree masks: load the model with "
            f"attn_implementation set to one of {', '.join(ATTENTION)}"
        )


@dataclass
class LoadedModel:
    """A model with its tokenizer, ready for `SpeculativeGenerator`."""

    model: Any
    tokenizer: Any
    spec: str

    @property
    def device(self) -> torch.device:
        """Return the device the model's weights are on."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Return the dtype of the model's weights."""
        return next(self.model.parameters()).dtype

    def encode_prompt(self, prompt: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Return the prompt's token ids, through the chat template when `chat`."""
        if chat:
            return chat_prompt_ids(self.tokenizer, prompt, system=system)
        return [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=False)]


def chat_prompt_ids(tokenizer: Any, prompt: str, *, system: str | None = None) -> list[int]:
    """Return the token ids of one user turn (after an optional system turn) and the assistant's header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the tokenizer has no chat template: leave out --chat and give the raw prompt")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Return the torch dtype for a name (None or 'auto': the checkpoint's own, float32 for GGUF)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_device(device: str | torch.device) -> torch.device:
    """Return the torch device, or raise ModelError when it is unknown or not available here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"unknown device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but no CUDA device is available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ModelError(f"device {device!r} is not supported: use cpu or cuda")
    return dev


def precheck(path_spec: str) -> None:
    """Refuse an unsupported model from its config alone, before any weights are read (when it can be read)."""
    path = Path(path_spec).expanduser()
    kind: str | None = None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model file {path_spec!r} does not exist")
        try:
            from gguf import GGUFReader

            field = GGUFReader(str(path)).fields["general.architecture"]
            kind = bytes(field.parts[field.data[0]]).decode()
        except Exception:
            return  # the full load reports what is wrong with the file
    elif (path / "config.json").is_file():
        import json

        try:
            kind = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError):
            return
    elif not path.exists() and not _in_hf_cache(path_spec):
        raise ModelError(
            f"no model directory or .gguf file at {path_spec!r}, and no model of that name in the local "
            "Hugging Face cache (nothing is downloaded)"
        )
    if kind is not None and kind not in SUPPORTED:
        raise ModelError(
            f"model type {kind!r} is not supported by the tree verifier (supported: {', '.join(SUPPORTED)})"
        )


def _in_hf_cache(name: str) -> bool:
    """Return whether a Hugging Face model `name` has a config in the local cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:
        return False


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "float32",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a causal LM and its tokenizer (no downloads) and check the verifier supports it."""
    from crest.decoding.tokenizer import load_tokenizer

    torch_dtype = resolve_dtype(dtype)
    dev = check_device(device)
    if attn_implementation not in ATTENTION:
        raise ModelError(
            f"attention implementation {attn_implementation!r} ignores tree masks: use one of {', '.join(ATTENTION)}"
        )
    path_spec = resolve_model_spec(spec)
    precheck(path_spec)
    tokenizer = load_tokenizer(path_spec).hf
    path = Path(path_spec).expanduser()
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    with warnings.catch_warnings(), _quiet_progress():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM

        try:
            model: Any
            if path.suffix == ".gguf":
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
            elif path.exists():
                model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(path_spec, local_files_only=True, **kwargs)
        except Exception as exc:
            raise ModelError(f"cannot load model {spec!r}: {str(exc).splitlines()[0][:300]}") from None
    check_supported(model)
    try:
        model = model.to(dev)
    except (RuntimeError, AssertionError) as exc:
        raise ModelError(f"cannot move model {spec!r} to {dev}: {str(exc).splitlines()[0][:300]}") from None
    return LoadedModel(model.eval(), tokenizer, spec)


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' weight-loading progress bars (its GGUF loader's plain tqdm too) during a load."""
    from transformers.utils import logging as hf_logging

    gguf_loader: Any = None
    with suppress(ImportError):
        import transformers.modeling_gguf_pytorch_utils as gguf_loader
    bar = getattr(gguf_loader, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_loader.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()
