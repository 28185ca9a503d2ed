"""Model loading: directories and GGUF files, dtype/device/attention options, refusals, the chat-template helper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.models import chat_prompt_ids, load_model
from crest.errors import ModelError
from tests.fix_models import tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("torch_threads")  # one torch thread per test, restored after

CHAT = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def word_tokenizer(*, chat: bool = True) -> Any:
    """Return a fast word-level tokenizer over w0..w59 and the chat roles (64 ids, <eos> = 63)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(60)] + ["system", "user", "assistant", "<eos>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="<eos>")
    if chat:
        tok.chat_template = CHAT
    return tok


def save_model_dir(root: Path, kind: str = "llama", *, chat: bool = True, weights: bool = True) -> Path:
    """Write a tiny model of family `kind` (config, tokenizer and optionally weights) to a directory."""
    root.mkdir(parents=True, exist_ok=True)
    if kind == "gpt2":
        from transformers import GPT2Config

        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64).save_pretrained(root)
    elif weights:
        tiny_model(kind, seed=1).save_pretrained(root)
    else:
        tiny_config(kind).save_pretrained(root)
    word_tokenizer(chat=chat).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize(
    ("dtype", "want"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), (torch.float64, torch.float64), (None, torch.float32)],
    ids=["float32", "bfloat16", "torch-float64", "checkpoint"],
)
def test_load_a_model_directory_with_dtype(llama_dir: Path, dtype: Any, want: torch.dtype) -> None:
    loaded = load_model(str(llama_dir), dtype=dtype)
    assert loaded.model.config.model_type == "llama" and loaded.dtype == want
    assert loaded.device == torch.device("cpu") and loaded.spec == str(llama_dir)
    assert loaded.model.config._attn_implementation == "sdpa"
    ids = loaded.encode_prompt("w1 w2 w3")
    assert ids == [1, 2, 3]
    result = SpeculativeGenerator(loaded.model, loaded.tokenizer, max_draft_tokens=4).generate(ids, max_new_tokens=8)
    with torch.no_grad():
        full = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
    assert result.output_token_ids == full[0, 3:].tolist()  # the loaded model decodes in its dtype like generate


@pytest.mark.parametrize("kind", ["qwen2", "mistral"], ids=["qwen2", "mistral"])
def test_other_supported_families_load(tmp_path: Path, kind: str) -> None:
    loaded = load_model(str(save_model_dir(tmp_path / kind, kind)), attn_implementation="eager")
    assert loaded.model.config.model_type == kind
    assert loaded.model.config._attn_implementation == "eager"


def test_chat_template_helper(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir))
    assert loaded.encode_prompt("w5 w6", chat=True) == [61, 5, 6, 62]  # user w5 w6 assistant
    assert loaded.encode_prompt("w5", chat=True, system="w9") == [60, 9, 61, 5, 62]
    with pytest.raises(ModelError, match="no chat template"):
        chat_prompt_ids(word_tokenizer(chat=False), "w1")


def test_an_unsupported_family_is_refused_before_reading_weights(tmp_path: Path) -> None:
    path = save_model_dir(tmp_path / "gpt2", "gpt2")
    assert not list(path.glob("*.safetensors"))  # nothing to load: only the config can refuse it
    with pytest.raises(ModelError, match="'gpt2' is not supported"):
        load_model(str(path))


@pytest.mark.parametrize(
    ("spec", "options", "match"),
    [
        ("missing/model-dir", {}, "no model directory"),
        ("/no/such/file.gguf", {}, "does not exist"),
        ("LLAMA_DIR", {"dtype": "float8"}, "unknown dtype"),
        ("LLAMA_DIR", {"device": "tpu"}, "device"),
        ("LLAMA_DIR", {"attn_implementation": "flash_attention_2"}, "ignores tree masks"),
    ],
    ids=["missing-dir", "missing-gguf", "bad-dtype", "bad-device", "flash-attention"],
)
def test_bad_specs_and_options_raise_model_errors(
    llama_dir: Path, spec: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ModelError, match=match):
        load_model(str(llama_dir) if spec == "LLAMA_DIR" else spec, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ModelError, match="no CUDA device"):
        load_model(str(llama_dir), device="cuda")


def test_weights_that_do_not_load_raise_a_model_error(tmp_path: Path) -> None:
    path = save_model_dir(tmp_path / "broken", weights=False)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="cannot load model"):
        load_model(str(path))


@pytest.mark.slow
def test_load_smollm2_gguf(smollm2_model: Any) -> None:
    loaded = smollm2_model  # load_model(path of the GGUF), shared by the session
    assert loaded.model.config.model_type == "llama" and loaded.dtype == torch.float32
    assert loaded.model.generation_config.eos_token_id == loaded.tokenizer.eos_token_id
    ids = loaded.encode_prompt("Hello!", chat=True)
    text = loaded.tokenizer.decode(ids)
    assert text.rstrip().endswith("<|im_start|>assistant") and "Hello!" in text
    assert loaded.encode_prompt("Hello!") == loaded.tokenizer.encode("Hello!", add_special_tokens=False)
