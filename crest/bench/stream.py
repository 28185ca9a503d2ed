"""The prompt stream a learning benchmark serves: prompts, their token ids, the model and the store's static version.

`prepare_stream` is what `crest bench learn` and `crest bench learn-loop` both do before serving: load the prompts,
check that the store has a published static version built with the model's tokenizer, load the model and encode
the prompts; the live tier is then built with the static version's build options and `refresh_live`'s top-t.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from crest.config import DEFAULT_TOP_T, IngestOptions
from crest.errors import CorpusError
from crest.learning.live import published_version, static_options


@dataclass
class PreparedStream:
    """What a learning benchmark serves: the prompts' token ids, the model, the static version and its options."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    loaded: Any
    version: dict[str, Any]  # the published static version's crest_stores columns
    options: IngestOptions  # the static version's build options with refresh_live's top-t
    fingerprint: str


def prepare_stream(opts: Any, *, model: str, dsn: str) -> PreparedStream:
    """Load the prompts, find the store's static version, load the model and check its tokenizer against the store."""
    from crest import db
    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import Tokenizer
    from crest.errors import FingerprintMismatch, StoreNotFound
    from crest.ingest.prompts import load_prompts

    prompts = load_prompts(opts.prompts, limit=opts.limit)
    if not prompts:
        raise CorpusError(f"no prompts in {opts.prompts!r}")
    with db.session(dsn) as conn:
        version = published_version(conn, opts.store, "static")
    if version is None:
        raise StoreNotFound(f"no published store named {opts.store!r}")
    options = replace(static_options(version["params"]), top_t=DEFAULT_TOP_T, budget=None)  # refresh_live's defaults
    loaded = load_model(model, device=opts.device, dtype=opts.dtype)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint  # the model's tokenizer, not loaded again
    if fingerprint != version["tokenizer_fingerprint"]:
        raise FingerprintMismatch(f"store {opts.store!r} was built with another tokenizer than model {model!r}")
    prompt_ids = [loaded.encode_prompt(p, chat=opts.chat) for p in prompts]
    return PreparedStream(prompts, prompt_ids, loaded, version, options, str(fingerprint))
