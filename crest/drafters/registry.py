"""The one registry of drafter names: `none`, `prompt`, `rest`, `crest`, `crest+prompt`.

`make_drafter` builds a drafter from parts already open (a store, a REST index); `open_drafter` opens those
parts first (a store through the SDK, a REST index from disk). Every command and benchmark goes through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crest.config import check_store_name, resolve_dsn
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.protocol import Drafter, NoneDrafter
from crest.drafters.store import StoreDrafter
from crest.errors import ConfigError

NAMES = ("none", "prompt", "rest", "crest", "crest+prompt")


def make_drafter(name: str, *, store: Any = None, rest_index: Any = None) -> Drafter | None:
    """Return the drafter called `name` (none, prompt, rest, crest, crest+prompt) built on its parts.

    `store` is a `crest_client.Store` (or anything with its `draft` method); `rest_index` a
    `crest.rest.RestIndex` or the directory of a saved one.
    """
    key = name.strip().lower()
    if key not in NAMES:
        raise ConfigError(f"unknown drafter {name!r}: use one of {', '.join(NAMES)}")
    if key == "none":
        return NoneDrafter()
    if key == "prompt":
        return PromptDrafter()
    if key == "rest":
        if rest_index is None:
            raise ConfigError("the rest drafter needs a REST index (build one with `crest rest-index build`)")
        from crest.drafters.suffix_array import RestDrafter, RestIndex

        index = RestIndex.load(rest_index) if isinstance(rest_index, str | Path) else rest_index
        return RestDrafter(index)
    if store is None:
        raise ConfigError(f"the {key} drafter needs a store (--store NAME)")
    crest = StoreDrafter(store)
    return crest if key == "crest" else MergedDrafter(crest, PromptDrafter())


def open_drafter(name: str, *, store: str | None, rest_index: str | None, dsn: str | None, fingerprint: str) -> Any:
    """Return the drafter `name` with its store or REST index opened."""
    from crest.drafters.registry import make_drafter

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
        from crest.drafters.suffix_array import RestIndex

        index = RestIndex.load(rest_index)
    return make_drafter(name, store=handle, rest_index=index)
