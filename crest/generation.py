"""What `crest generate` and `crest rest-index build` do, between parsing and the library.

Loads the model once, opens the drafter's parts (a store through the SDK, a REST index from disk), runs
each prompt and prints either the text (streamed as it is accepted) or one JSON object per prompt.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from crest.config import check_store_name, resolve_dsn, resolve_model_spec
from crest.corpus import read_jsonl
from crest.errors import ConfigError, CorpusError


def read_prompts(path: str) -> Iterator[str]:
    """Yield the `prompt` of each JSONL line (also accepts `turns[0]` and `text`)."""
    for number, record in read_jsonl(path):
        text = None
        if isinstance(record, dict):
            text = record.get("prompt") or (record.get("turns") or [None])[0] or record.get("text")
        if not isinstance(text, str):
            raise CorpusError(f'{path!r} line {number} has no "prompt" string')
        yield text


def open_drafter(name: str, *, store: str | None, rest_index: str | None, dsn: str | None, fingerprint: str) -> Any:
    """Return the drafter `name` with its store or REST index opened."""
    from crest.drafters import make_drafter

    handle = None
    if name in ("crest", "crest+prompt"):
        if not store:
            raise ConfigError(f"--drafter {name} needs --store NAME")
        from crest_client import Store

        handle = Store.connect(resolve_dsn(dsn), check_store_name(store), tokenizer_fingerprint=fingerprint)
    index = None
    if name == "rest":
        if not rest_index:
            raise ConfigError("--drafter rest needs --rest-index DIR")
        from crest.rest import RestIndex

        index = RestIndex.load(rest_index)
    return make_drafter(name, store=handle, rest_index=index)


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
    from crest.models import load_model
    from crest.tokenize import load_tokenizer
    from crest.verify import SpeculativeGenerator

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


def build_rest_index(inputs: Sequence[str], *, out: str, tokenizer: str, fmt: str) -> tuple[int, int]:
    """Tokenize a corpus and write its REST index to `out`; return (bytes, tokens)."""
    from crest.corpus import CorpusReport, iter_documents
    from crest.rest import RestIndex
    from crest.tokenize import load_tokenizer, tokenize_corpus

    tok = load_tokenizer(resolve_model_spec(tokenizer))
    with tempfile.TemporaryDirectory() as work:
        corpus = tokenize_corpus(iter_documents(list(inputs), fmt=fmt, report=CorpusReport()), tok, workdir=Path(work))
        if corpus.tokens_total == 0:
            raise CorpusError("the corpus has no tokens")
        index = RestIndex.build(corpus.tokens, corpus.doc_offsets)
        index.save(out)
    return index.nbytes, corpus.tokens_total
