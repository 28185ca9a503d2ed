"""Writing a model crest loads as a plain Hugging Face directory, for engines that need one (vLLM).

crest loads a Hugging Face directory or name, a `.gguf` file, or `smollm2` (the packaged GGUF); vLLM serves a
Hugging Face directory. `export_hf` loads the model exactly as crest does (so the weights are the ones crest
verifies with: a GGUF is dequantized by transformers), drops any quantization config (the weights written are
plain floats), and saves the weights as safetensors with the config, the generation config and the tokenizer.
"""

from __future__ import annotations

import stat
import warnings
from pathlib import Path
from typing import Any

from crest._outputs import created_mode
from crest.errors import ConfigError, ModelError

EXPORT_DTYPES = ("float32", "float16", "bfloat16")


def export_hf(model: str, out: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the model `model` (a HF dir or name, a .gguf, or smollm2) to the directory `out`; return its path.

    Raises ConfigError when `out` is a file, or a non-empty directory and not `overwrite`, or the dtype is not
    one vLLM serves; ModelError when the model cannot be loaded or written.
    """
    from crest.decoding.models import load_model

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"unknown export dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)}")
    target = Path(out).expanduser()
    _check_target(target, overwrite=overwrite)
    save_hf(load_model(model, dtype=dtype), target)
    return target


def save_hf(loaded: Any, target: Path) -> None:
    """Write a loaded model (weights as safetensors, config, tokenizer, no quantization config) into `target`."""
    drop_quantization(loaded.model)
    try:
        target.mkdir(parents=True, exist_ok=True)
        before = _files(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded.model.save_pretrained(str(target), safe_serialization=True)
            loaded.tokenizer.save_pretrained(str(target))
        # safetensors writes its file 0600: readable as any file the user writes (vLLM may run as another user)
        created_mode(path for path, seen in _files(target).items() if before.get(path) != seen)
    except OSError as exc:
        raise ModelError(f"cannot write the model to {str(target)!r}: {exc}") from None


def drop_quantization(model: Any) -> None:
    """Forget in place how a loaded model was quantized on disk: its weights are plain floats once loaded.

    transformers keeps a GGUF model's quantizer, which refuses to save, and its quantization config, which would
    make an engine look for quantized weights.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if getattr(config, "_pre_quantization_dtype", None) is not None:
        delattr(config, "_pre_quantization_dtype")


def _files(directory: Path) -> dict[Path, tuple[int, int, int]]:
    """Return each regular file in `directory` with what changes when it is written (inode, size, mtime)."""
    found = {}
    for path in directory.iterdir():
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):
            found[path] = (info.st_ino, info.st_size, info.st_mtime_ns)
    return found


def _check_target(target: Path, *, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{str(target)!r} is a file: give a directory to write the model to")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"{str(target)!r} is not empty: give an empty or new directory, or --force")
