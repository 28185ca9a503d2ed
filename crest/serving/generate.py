"""`crest generate`'s composition root: one model loaded once, one drafter opened, prompts generated in turn.

`open_generation` checks what it is given before the model loads (the drafter's name and parts, the store, the
database's schema), then loads the model, opens the drafter with the model's tokenizer fingerprint and wraps
both in a `SpeculativeGenerator`. It reads the database and never migrates it: a schema behind this crest's
migrations is said in one line (`crest db upgrade` brings it up), a database with no crest schema holds no
store, and a database that does not answer costs store drafts only (the store drafter says so once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from crest.decoding.drafter import Drafter
from crest.decoding.generator import GenerationResult, SpeculativeGenerator
from crest.decoding.models import LoadedModel


@dataclass
class Generation:
    """A loaded model, its opened drafter and the generator over both; close it (or use `with`) when done."""

    loaded: LoadedModel
    drafter: Drafter
    generator: SpeculativeGenerator

    def generate(self, prompt: str, *, chat: bool = False, **options: Any) -> GenerationResult:
        """Generate after one prompt (through the chat template when `chat`) with the opened drafter.

        `options` are `SpeculativeGenerator.generate`'s: max_new_tokens, temperature, top_p, top_k, seed, stop,
        on_text.
        """
        return self.generator.generate(self.loaded.encode_prompt(prompt, chat=chat), drafter=self.drafter, **options)

    def close(self) -> None:
        """Close what the drafter opened (its store, its dense part)."""
        from crest.drafters.registry import close_drafter

        close_drafter(self.drafter)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def open_generation(
    model: str,
    *,
    drafter: str,
    store: str | None = None,
    rest_index: str | None = None,
    max_draft_tokens: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    dsn: str | None = None,
    read_dsn: str | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> Generation:
    """Check the drafter and its store, load `model`, open the drafter and return the generation over both."""
    from crest.decoding.generator import check_draft_tokens
    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import Tokenizer
    from crest.drafters.registry import check_drafter, kind_of, open_drafter

    check_draft_tokens(max_draft_tokens)
    name = check_drafter(drafter, where="generate", store=store, rest_index=rest_index)
    if "store" in kind_of(name).needs:
        check_readable(str(store), dsn=read_dsn or dsn)  # said before the model loads
    loaded = load_model(model, device=device, dtype=dtype)
    generator = SpeculativeGenerator(
        loaded.model, loaded.tokenizer, max_draft_tokens=max_draft_tokens, on_progress=on_progress
    )
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint  # the model's tokenizer, not loaded again
    opened = open_drafter(name, store=store, rest_index=rest_index, dsn=read_dsn or dsn, fingerprint=fingerprint)
    return Generation(loaded, opened, generator)


def check_readable(store: str, *, dsn: str | None = None) -> None:
    """Raise unless `store` can be read: a schema behind this crest's (DatabaseError), no schema or no such store
    (StoreNotFound); a database that does not answer passes (the store drafter says so and drafts nothing)."""
    from crest_client.hosts import resolve_read_dsn

    from crest.db.connection import head_revision, schema_revision
    from crest.drafters.store import check_store
    from crest.errors import DatabaseError, StoreNotFound

    url = resolve_read_dsn(dsn)
    try:
        revision = schema_revision(url)
    except DatabaseError:
        return  # not answering: drafts nothing until it does
    if revision is None:
        raise StoreNotFound(f"no published store named {store!r}: the database has no crest schema yet")
    head = head_revision()
    if revision != head:
        raise DatabaseError(
            f"the database's crest schema is at revision {revision}, not this crest's {head}: "
            "`crest db upgrade` migrates one that is behind"
        )
    check_store(store, dsn=url)
