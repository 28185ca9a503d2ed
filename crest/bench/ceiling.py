"""The suffix ceiling: how far any rule choosing among a context's stored suffixes could draft, on known text.

A step of the replay (`crest.bench.replay`) can draft from the tree of any stored suffix of the context. A rule
picks one without knowing what follows: `longest`, or `expected` (`crest_client.choice`), which a pruned build
decided at ingest (a store decided at ingest is read by its longest stored suffix under either rule, as the SDK
reads it). The ceiling picks, with hindsight, the tree whose path matches the most of the known
continuation: no rule that chooses one stored tree per step (of the same size) drafts more, so a rule's gap to the
ceiling is what a better rule can still win, and the ceiling's gap to a target is what only the stored trees, that
is the corpus, can buy. Each rule walks the continuation on its own (its steps land on different positions), all
reading the same rows; the figures also count the ceiling's steps where no stored tree holds the next token and
where the context has no stored suffix at all. Rows are read straight from the store's published static version,
so on a pruned store the ceiling is over the rows it kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crest_client.choice import built_max_matches, built_rule, choose, decided_at_ingest
from crest_client.codec import decode_tree
from crest_client.draft import Draft
from psycopg import sql

from crest import db
from crest.bench.replay import matched_depth
from crest.decoding.policy import room_left
from crest.decoding.tree import limit_depth

RULES = ("longest", "expected", "ceiling")

Step = tuple[list[tuple[int, int, bytes]], list[int], bool]  # rows longest first, their depths, room for a draft


@dataclass
class Ceiling:
    """One store's M under each rule and under the hindsight ceiling, on the same continuations."""

    store: str
    version: int
    rule: str  # the --suffix-rule it was built with
    prompts: int
    tokens: int  # new tokens replayed
    longest: float
    expected: float
    ceiling: float
    no_next: float  # share of the ceiling's steps where no stored suffix's tree has the next token
    no_suffix: float  # share of the ceiling's steps whose context has no stored suffix


class SuffixRows:
    """Every stored suffix of a context, read from one store version: (n, count, tree) rows, longest first."""

    def __init__(self, conn: Any, store: Any) -> None:
        self.conn, self.store, self.info = conn, store, store.info
        table = db.ngram_table(int(self.info.id))
        self.query = sql.SQL("SELECT n, count, tree FROM {} WHERE key = ANY(%s) ORDER BY n DESC").format(table)

    def drafts(self, context: Sequence[int]) -> tuple[list[tuple[int, int, bytes]], list[Draft]]:
        """Return the context's stored suffix rows, longest first, and their decoded trees."""
        keys = [k for k in self.store.keys(context) if k is not None]
        if not keys:
            return [], []
        rows = [(int(n), int(c), bytes(t)) for n, c, t in self.conn.execute(self.query, (keys,)).fetchall()]
        return rows, [decode_tree(t, n=n, table=self.info.table) for n, _, t in rows]


class _Positions:
    """One continuation's stored suffix rows and their trees' matched depths, read once per position."""

    def __init__(
        self,
        reader: SuffixRows,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        *,
        max_nodes: int,
        max_positions: int,
    ) -> None:
        self.reader, self.max_nodes, self.max_positions = reader, max_nodes, max_positions
        self.prompt, self.out = [int(t) for t in prompt_ids], [int(t) for t in output_ids]
        self.seen: dict[int, Step] = {}

    def at(self, done: int, *, max_new_tokens: int) -> Step:
        """Return the rows of the context after `done` tokens, their depths, and whether a draft fits there."""
        if done not in self.seen:
            context = self.prompt + self.out[:done]
            room = room_left(
                context_length=len(context),
                generated=done,
                max_new_tokens=max_new_tokens,
                max_positions=self.max_positions,
            )
            rows, trees = self.reader.drafts(context) if room > 0 else ([], [])
            cut = [limit_depth(t.truncate(self.max_nodes), room) for t in trees]
            self.seen[done] = rows, [matched_depth(t, self.out[done:]) if len(t) else 0 for t in cut], room > 0
        return self.seen[done]


def measure_ceiling(
    store: Any,
    conn: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_nodes: int = 64,
    max_new_tokens: int = 128,
    max_positions: int = 1 << 30,
) -> Ceiling:
    """Replay `longest`, `expected` and the hindsight ceiling on (prompt ids, continuation ids) pairs."""
    reader = SuffixRows(conn, store)
    max_matches = built_max_matches(store.info.params)  # as the SDK's `expected` reads it
    decided = decided_at_ingest(store.info.params)
    totals = dict.fromkeys(RULES, 0)  # steps per rule
    new_tokens = drafted = no_next = no_suffix = 0
    for prompt_ids, output_ids in pairs:
        steps_of = _Positions(
            reader, prompt_ids, output_ids[:max_new_tokens], max_nodes=max_nodes, max_positions=max_positions
        )
        out = steps_of.out
        new_tokens += len(out)
        for rule in RULES:
            done = steps = 0
            while done < len(out):
                rows, found, fits = steps_of.at(done, max_new_tokens=max_new_tokens)
                if not rows:
                    accepted = 0
                elif rule == "longest":
                    accepted = found[0]
                elif rule == "expected":  # a store decided at ingest is read by its longest row, whatever the rule
                    accepted = found[0 if decided else choose(rows, max_matches=max_matches)]
                else:
                    accepted = max(found)
                if rule == "ceiling" and fits:
                    drafted += 1
                    no_suffix += not rows
                    no_next += not accepted
                done += min(accepted, len(out) - done - 1) + 1
                steps += 1
            totals[rule] += steps
    ceiling_steps = max(1, drafted)  # steps with room for a draft (not a continuation's last token)
    return Ceiling(
        store=store.name,
        version=int(store.info.id),
        rule=built_rule(store.info.params),
        prompts=len(pairs),
        tokens=new_tokens,
        longest=_m(new_tokens, totals["longest"]),
        expected=_m(new_tokens, totals["expected"]),
        ceiling=_m(new_tokens, totals["ceiling"]),
        no_next=round(no_next / ceiling_steps, 4),
        no_suffix=round(no_suffix / ceiling_steps, 4),
    )


def _m(tokens: int, steps: int) -> float:
    return round(tokens / steps, 4) if steps else 0.0


@dataclass(frozen=True)
class ReferenceOptions:
    """What recorded greedy continuations depend on besides model and prompts (`crest.bench.references`)."""

    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 128


def run_ceiling(
    stores: Sequence[str],
    prompts: Sequence[str],
    *,
    dsn: str,
    model: str = "smollm2",
    chat: bool = False,
    references: Path | None = None,
    max_nodes: int = 64,
    options: ReferenceOptions = ReferenceOptions(),
    note: Callable[[str], None] = lambda line: None,
) -> list[Ceiling]:
    """Decode the prompts plainly (or read `references`/references.json), then measure each store's ceiling."""
    import contextlib

    import psycopg
    from crest_client import Store

    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import Tokenizer

    loaded = load_model(model, device=options.device, dtype=options.dtype)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint
    with contextlib.ExitStack() as stack:
        # opened before decoding: a store built with another tokenizer is refused at once
        handles = [
            stack.enter_context(Store.connect(dsn, name, tokenizer_fingerprint=fingerprint, timeout=5.0, cache_size=0))
            for name in stores
        ]
        conn = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        prompt_ids = [loaded.encode_prompt(p, chat=chat) for p in prompts]
        outputs, max_positions = _references(loaded, prompt_ids, references=references, options=options, note=note)
        pairs = list(zip(prompt_ids, outputs, strict=True))
        found = []
        for store in handles:
            note(f"replaying {store.name}")
            found.append(
                measure_ceiling(
                    store,
                    conn,
                    pairs,
                    max_nodes=max_nodes,
                    max_new_tokens=options.max_new_tokens,
                    max_positions=max_positions,
                )
            )
    return found


def _references(
    loaded: Any,
    prompt_ids: list[list[int]],
    *,
    references: Path | None,
    options: ReferenceOptions,
    note: Callable[[str], None],
) -> tuple[list[list[int]], int]:
    """Return the prompts' plain greedy continuations (read from `references` when recorded there) and the
    model's positions."""
    from crest.bench.references import REFERENCES, known_references, record_references, reference_key
    from crest.decoding.drafter import NoneDrafter
    from crest.decoding.generator import SpeculativeGenerator

    plain = SpeculativeGenerator(loaded.model, loaded.tokenizer, max_draft_tokens=0)
    key = reference_key(loaded, prompt_ids, options)
    known = known_references(references / REFERENCES, key, len(prompt_ids)) if references else None
    if known is not None:
        note(f"read the plain greedy continuations of {len(prompt_ids)} prompts from {references}")
        return [list(map(int, r)) for r in known["references"]], plain.max_positions
    outputs, seconds = [], 0.0
    for i, ids in enumerate(prompt_ids):
        note(f"plain greedy decoding, prompt {i + 1}/{len(prompt_ids)}")
        ref = plain.generate(ids, drafter=NoneDrafter(), max_new_tokens=options.max_new_tokens)
        outputs.append(list(ref.output_token_ids))
        seconds += ref.seconds
    if references is not None:
        references.mkdir(parents=True, exist_ok=True)
        record_references(references, loaded, prompt_ids, options, outputs, seconds / max(1, len(outputs)))
    return outputs, plain.max_positions
