"""The model's own answers as a corpus (DReSD's best datastore): batched greedy generation over prompts.

DReSD finds a datastore works best when built from the target model's own outputs, and so do crest's n-gram stores
(docs/benchmarks.md: SmolLM2's answers in the corpus lift crest alone from 1.68 to 1.99-2.12 on code). `write_answers`
writes one JSONL document per prompt, `{"text": prompt + greedy response}` (the prompt as the model saw it: through
the chat template with `chat`, special tokens kept, so a dense part embeds the response in its real context), ready
for `crest ingest` (and its `--dense-model`); with `answers_only` a document is the response alone, what the model
writes, for `crest ingest --suffix-judge`. Generation is batched (left-padded, prompts sorted by length), greedy,
cut at the end-of-sequence token, so each response equals the model's unbatched greedy output. `crest answer` runs it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from crest._outputs import output_file, replacing
from crest.errors import ConfigError

Generate = Callable[[Sequence[Sequence[int]]], Iterator[list[tuple[int, list[int]]]]]  # prompts -> (index, response)


def respond(
    loaded: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128, batch: int = 16
) -> list[list[int]]:
    """Return the greedy response of each prompt (token ids, cut after end-of-sequence), in batches."""
    found = dict(
        pair for done in responses(loaded, prompts, max_new_tokens=max_new_tokens, batch=batch) for pair in done
    )
    return [found[i] for i in range(len(prompts))]


def responses(
    loaded: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128, batch: int = 16
) -> Iterator[list[tuple[int, list[int]]]]:
    """Yield each batch's (prompt index, greedy response) pairs as it finishes, shorter prompts first."""
    from crest.decoding.generator import eos_ids

    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None) or (min(eos) if eos else 0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad little
    for lo in range(0, len(order), batch):
        picked = order[lo : lo + batch]
        width = max(len(prompts[i]) for i in picked)
        ids = torch.full((len(picked), width), pad, dtype=torch.long)  # [B, W], left-padded
        mask = torch.zeros_like(ids)
        for row, i in enumerate(picked):
            ids[row, width - len(prompts[i]) :] = torch.tensor(list(prompts[i]))
            mask[row, width - len(prompts[i]) :] = 1
        with torch.no_grad():
            out = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
            )[:, width:].tolist()  # [B, new]
        stops = [next((j + 1 for j, t in enumerate(row) if t in eos), len(row)) for row in out]
        yield [(i, [int(t) for t in out[row][: stops[row]]]) for row, i in enumerate(picked)]


def write_answers(
    loaded: Any,
    prompts: Sequence[str],
    out: Path,
    *,
    chat: bool = False,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 512,
    batch: int = 16,
    answers_only: bool = False,
    generate: Generate | None = None,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write one `{"text": prompt + greedy response, "prompt": prompt}` line per prompt to `out`; return figures.

    With `answers_only` a line is `{"text": response}`. Lines go to `out` + `.partial` as each batch finishes,
    renamed to `out` once every prompt is answered: a run stopped early keeps its answers there, and `out` is never
    half written. `generate` yields the responses (default: `responses` with `max_new_tokens` and `batch`;
    `crest.integrations.vllm_answers` has vLLM's).
    """
    encoded = [loaded.encode_prompt(p, chat=chat) for p in prompts]
    kept = [ids for ids in encoded if 0 < len(ids) <= max_prompt_tokens]  # long prompts would dominate the batch
    if not kept:
        raise ConfigError(f"no prompt of 1 to {max_prompt_tokens} tokens to respond to")
    started, written, new = time.perf_counter(), 0, 0
    partial = check_out(out)
    out = output_file(out, option="--out")
    with replacing(out, partial=partial) as sink:
        made = generate(kept) if generate else responses(loaded, kept, max_new_tokens=max_new_tokens, batch=batch)
        for done in made:
            for i, response in done:
                if answers_only:  # what the model writes, without its end-of-sequence token
                    line = {"text": loaded.tokenizer.decode(response, skip_special_tokens=True)}
                else:  # the prompt as the model read it too, where the answer starts (`crest bench proposer`)
                    line = {"text": loaded.tokenizer.decode(kept[i] + response, skip_special_tokens=False),
                            "prompt": loaded.tokenizer.decode(kept[i], skip_special_tokens=False)}  # fmt: skip
                sink.write((json.dumps(line, ensure_ascii=False) + "\n").encode())
                written, new = written + 1, new + len(response)
            sink.flush()
            note(f"responses {written}/{len(kept)}, {new:,} tokens, {time.perf_counter() - started:.0f} s")
    seconds = time.perf_counter() - started
    return {"documents": written, "skipped": len(encoded) - len(kept), "new_tokens": new, "seconds": seconds}


def check_out(out: Path) -> Path:
    """Return the partial file `write_answers` writes before `out`; raise ConfigError when either cannot be written.

    Nothing is left behind: a partial file made to try the directory is removed again.
    """
    out = output_file(out, option="--out")  # written through a link, never over a device
    partial = out.with_name(out.name + ".partial")
    if partial.is_symlink() or (partial.exists() and not partial.is_file()):  # a FIFO would block the open below
        raise ConfigError(
            f"{str(partial)!r} is not a regular file (a directory, link, FIFO or device): remove it or give --out "
            "another file name"
        )
    existed = partial.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write {str(partial)!r}: {exc.strerror or exc}") from None
    if not existed:
        partial.unlink()
    return partial
