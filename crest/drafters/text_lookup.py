"""`crest lookup`: the draft tree a store holds for the end of a text, the stored suffix it is for, and why.

`lookup_text` encodes a text with the store's tokenizer (or a given one, which must match the store's
fingerprint) and returns the draft tree of the stored suffix the suffix rule picks (`crest_client.choice`), with
that suffix and each node's text piece; `tree_source` says where that suffix's stored tree came from (its own
occurrences, or a choice made at ingest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg
from crest_client import Store
from crest_client.choice import built_rule, decided_at_ingest
from crest_client.draft import Draft

from crest.config import check_store_name, resolve_model_spec
from crest.errors import FingerprintMismatch

LOOKUP_TIMEOUT = 5.0  # seconds for `crest lookup` to connect and read the store, and for its one draft()


@dataclass
class TextLookup:
    """The draft tree stored for the end of a text, with each node's text piece (empty when none matched)."""

    draft: Draft | None
    pieces: list[str]
    rule: str = "expected"  # the suffix rule that picked the suffix
    suffix_ids: list[int] = field(default_factory=list)  # the matched suffix: the text's last draft.n tokens
    suffix_pieces: list[str] = field(default_factory=list)
    source: str = ""  # where the matched row's tree came from (the store's --suffix-rule)


def lookup_text(
    dsn: str,
    store: str,
    text: str,
    *,
    tokenizer: str | None = None,
    max_nodes: int = 64,
    rule: str | None = None,
    timeout: float = LOOKUP_TIMEOUT,
) -> TextLookup:
    """Return the tree for the stored suffix of `text` that `rule` picks (tokenizer: the store's own unless given)."""
    from crest.decoding.tokenizer import load_tokenizer

    check_store_name(store)
    with Store.connect(dsn, store, cache_size=0, timeout=timeout, connect_timeout=timeout, rule=rule) as handle:
        tok = load_tokenizer(resolve_model_spec(tokenizer or handle.info.tokenizer))
        if tok.fingerprint != handle.info.fingerprint:
            raise FingerprintMismatch(f"store {store!r} was built with another tokenizer than {tok.spec!r}")
        ids = tok.encode(text)
        draft = handle.draft(ids, max_nodes=max_nodes, tier="static")  # the published version's own row
        built = built_rule(handle.info.params)
        used = built if decided_at_ingest(handle.info.params) else handle.rule  # decided: the one row fetched drafts
        source = tree_source(dsn, handle, ids[len(ids) - draft.n :] if draft is not None and draft.n else [], used)
    tokens = draft.tokens.tolist() if draft is not None else []
    suffix = ids[len(ids) - draft.n :] if draft is not None and draft.n else []
    return TextLookup(
        draft=draft,
        pieces=[tok.hf.decode([int(t)]) for t in tokens],
        rule=used,
        suffix_ids=[int(t) for t in suffix],
        suffix_pieces=[tok.hf.decode([int(t)]) for t in suffix],
        source=source,
    )


def tree_source(dsn: str, handle: Store, suffix: list[int], rule: str) -> str:
    """Return where the matched suffix's stored tree came from: its own n-gram's, or decided at ingest."""
    if not suffix:
        return ""
    built = built_rule(handle.info.params)
    if not decided_at_ingest(handle.info.params):
        return f"its own occurrences (the {rule} rule chose this suffix at lookup)"
    keys = handle.candidate_keys(suffix)  # the matched n-gram and its suffixes the filter may hold, longest first
    query = psycopg.sql.SQL("SELECT n, count FROM {} WHERE key = ANY(%s) ORDER BY n DESC").format(
        psycopg.sql.Identifier(f"crest_ngrams_s{handle.info.id}")
    )
    chosen = ""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(query, (keys,)).fetchall()
        if built == "auto":  # which rule the build chose on its held-out slice (crest.ingest.suffix_choice)
            got = conn.execute("SELECT figures->'suffix_choice' FROM crest_stores WHERE id = %s", (handle.info.id,))
            chosen = ((got.fetchone() or [None])[0] or {}).get("rule", "?")
    counts = {int(n): int(c) for n, c in rows}
    own = counts.pop(len(suffix), 0)
    shorter = ", ".join(f"n={n}: seen {c}" for n, c in counts.items())
    if built == "auto" and chosen == "longest":
        return f"its own occurrences (seen {own}): the longest stored suffix, the rule auto chose at ingest"
    if built == "auto":
        built = "auto: prune"
    if built in ("prune", "auto: prune"):
        return f"its own occurrences (seen {own}), kept at ingest ({built}): the suffix the expected rule chooses, " + (
            f"over its kept shorter suffixes ({shorter})" if shorter else "no shorter suffix is kept"
        )
    if not shorter:
        return f"decided at ingest ({built}): its own occurrences (seen {own}); no shorter suffix is stored"
    return f"decided at ingest ({built}): its own occurrences (seen {own}) backed off to its suffixes' ({shorter})"
