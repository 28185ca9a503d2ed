"""What a finished request teaches its store: its tokens, and how its drafts went, part by part. A finished request
(not cancelled, not failed) teaches its store the prompt's last `PROMPT_TAIL` tokens (the context its first output
tokens followed) and its output (`served_tokens`): the same row in this process's recent tier at once and in the
learned log, written by the store's `crest_client.learner.Learner` off the decoding path (`record_outcome`, through
`crest.drafting.DraftHub.learn`), from which other replicas and a restarted process take it whole (the live tier's
n-gram counts take only the prompt's last max-n of it: `crest.learning.journal.counted_from`). Its learned row also
says how it went (`request_stats`): target forwards, new tokens, verified and accepted draft nodes, and how many
accepted tokens each named part's tree held before the parts were merged (`tally_parts`, once per step, from the
trees the drafter reports through `drafted_parts`: the static tier, the live tier, the prompt, or any part a new
drafter names). `crest serve` and the vLLM proposer both call these.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from crest_client.draft import Draft
from crest_client.learner import DenseRows

from crest.config import IngestOptions
from crest.decoding.drafter import drafted_parts

log = logging.getLogger(__name__)

# prompt tokens before a finished request's output that its learned row keeps (its `prompt_tokens`), in this
# process's recent tier and in the log every replica and a restarted process read it from: in a chat the last max-n
# are the template's assistant header, the same in every request, so an answer served before would only be found a
# few tokens into its repeat. `crest bench proposer --chat` (16 held-out self-corpus answers, seen once, c = 8,
# K 16): M 12.88 with the max-n tail, 14.22 (the ceiling) with 64
PROMPT_TAIL = 64


def store_max_n(store: Any, *, default: int = IngestOptions().max_n) -> int:
    """Return the longest n-gram an opened store keys on (a store still connecting: the ingest default)."""
    inner = getattr(store, "store", None) or store  # a PendingStore once its database answered
    return int(getattr(getattr(inner, "info", None), "max_n", default))


def served_tokens(prompt: Sequence[int], output: Sequence[int], *, tail: int = PROMPT_TAIL) -> tuple[list[int], int]:
    """Return the ids a finished request teaches (the prompt's last `tail`, then the output) and that tail's length."""
    kept = [int(t) for t in prompt[max(0, len(prompt) - tail) :]] if tail > 0 else []
    return kept + [int(t) for t in output], len(kept)


def path_length(tree: Draft, tokens: Sequence[int]) -> int:
    """Return how many leading `tokens` the tree holds as one path from its root."""
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))}
    at = -1
    for depth, token in enumerate(tokens):
        found = child.get((at, int(token)))  # a trie: one child per token
        if found is None:
            return depth
        at = found
    return len(tokens)


def tally_parts(
    counts: dict[str, int], drafter: Any, verified: Draft, *, context_length: int, accepted: Sequence[int]
) -> None:
    """Add to `counts` how many of a step's accepted draft tokens each part's tree held along the accepted path."""
    if not accepted:
        return
    try:
        for name, tree in drafted_parts(drafter, verified, context_length=context_length).items():
            counts[name] = counts.get(name, 0) + path_length(tree, accepted)
    except Exception as exc:  # a figure that cannot be counted must never fail the step
        log.debug("counting accepted tokens per part failed: %s", exc)


def row_stats(*, steps: int, new_tokens: int, drafted: int, accepted: int, parts: Mapping[str, int]) -> dict[str, int]:
    """Return a request's figures as its learned row keeps them: `crest_client.learner.STATS`, `accepted_<part>`."""
    return {
        "steps": int(steps),
        "new_tokens": int(new_tokens),
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        **{f"accepted_{name}": int(count) for name, count in sorted(parts.items())},
    }


def request_stats(outcome: Any) -> dict[str, int]:
    """Return a finished scheduler request's figures for its learned row (`row_stats`)."""
    result = outcome.result
    return row_stats(
        steps=result.forward_passes, new_tokens=len(result.output_token_ids),
        drafted=outcome.accepted_draft_tokens + outcome.rejected_draft_tokens,
        accepted=outcome.accepted_draft_tokens, parts=getattr(outcome, "accepted_parts", {}),
    )  # fmt: skip


class Teach(Protocol):
    """How a finished request teaches its store (`crest.drafting.DraftHub.learn` bound to the store's name)."""

    def __call__(
        self, prompt: Sequence[int], output: Sequence[int], *, stats: Mapping[str, int], dense: DenseRows | None
    ) -> None: ...


def record_outcome(teach: Teach, future: Future[Any]) -> None:
    """Teach a finished request's tokens and figures to its store; a cancelled or failed one: nothing."""
    if future.cancelled() or future.exception() is not None:
        return
    outcome = future.result()
    if outcome.cancelled or not outcome.result.output_token_ids:
        return
    result = outcome.result
    # the states' row positions in the row `teach` writes (`served_tokens`, the same tail): states exist only from
    # the prompt's last token on, so a longer tail moves them, never adds any
    ids, prompt_tokens = served_tokens(result.prompt_token_ids, result.output_token_ids)
    dense = served_dense(outcome, cut=len(result.prompt_token_ids) - prompt_tokens, n_tokens=len(ids))
    teach(result.prompt_token_ids, result.output_token_ids, stats=request_stats(outcome), dense=dense)


def served_dense(outcome: Any, *, cut: int, n_tokens: int) -> DenseRows | None:
    """Return a finished request's recorded states as its learned row's dense vectors, or None.

    The learned row is prompt + output without its first `cut` ids; a state at row position p predicted the
    row's token p + 1, so only states of positions 0 .. n_tokens - 2 are kept (the last emitted states may
    predict tokens the request did not keep: eos, a stop string, the length limit).
    """
    vectors, meta = getattr(outcome, "dense", None), getattr(outcome, "dense_version", None)
    if vectors is None or meta is None:
        return None
    first = int(outcome.dense_from) - cut - 1  # row position of the first vector's state
    skip = max(0, -first)
    keep = max(0, min(len(vectors), n_tokens - 1 - first) - skip)
    if keep == 0:
        return None
    return DenseRows(int(meta), first + skip, vectors[skip : skip + keep])
