"""`crest generate`: load the model once, open the drafter, run each prompt and print text or JSON lines."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from crest.bench.prompts import read_prompts
from crest.config import resolve_model_spec
from crest.drafters.registry import open_drafter
from crest.errors import ConfigError


def run_generate(
    *,
    prompt: str | None,
    prompts_file: str | None,
    model: str,
    store: str | None,
    drafter: str,
    rest_index: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    chat: bool,
    max_draft_tokens: int | None,
    stop: Sequence[str],
    device: str,
    dtype: str,
    as_json: bool,
    dsn: str | None,
) -> None:
    """Generate for one prompt or a file of prompts, printing text or JSON lines."""
    from crest.decoding.generator import SpeculativeGenerator
    from crest.decoding.models import load_model
    from crest.ingest.tokenizer import load_tokenizer

    if (prompt is None) == (prompts_file is None):
        raise ConfigError("give a PROMPT or --prompts FILE (one of them)")
    if max_new_tokens <= 0:
        raise ConfigError("--max-new-tokens must be positive")
    texts = [prompt] if prompt is not None else list(read_prompts(str(prompts_file)))
    loaded = load_model(model, device=device, dtype=dtype)
    fingerprint = load_tokenizer(resolve_model_spec(model)).fingerprint
    draft_source = open_drafter(drafter, store=store, rest_index=rest_index, dsn=dsn, fingerprint=fingerprint)
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, max_draft_tokens=max_draft_tokens)
    for text in texts:
        ids = loaded.encode_prompt(text, chat=chat)
        stream = None if as_json else _write_now
        result = gen.generate(
            ids,
            drafter=draft_source,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            on_text=stream,
        )
        if as_json:
            payload = result.to_json()
            payload.pop("accepted_per_step", None)
            print(json.dumps(payload), flush=True)
        else:
            print(
                f"\n-- {result.new_tokens} tokens, {result.forward_passes} forwards, "
                f"M = {result.mean_accepted_length:.2f}, {result.tokens_per_second:.1f} tokens/s",
                file=sys.stderr,
            )


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
