"""The one registry of drafter names: `none`, `prompt`, `rest`, `crest`, `crest+prompt`.

Each name maps to the part it needs (nothing, a store, or a REST index) and a builder taking that part once
open. `check_drafter` checks a name and the names of its parts without opening anything, so a command can
refuse bad options before it loads a model; `make_drafter` builds a drafter on parts already open (a
benchmark's store handles and indexes); `open_drafter` opens the part first (a store through the SDK, which
drafts nothing while the database is down, or a REST index from disk). Every command and benchmark goes
through here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crest_client.names import check_store_name

from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.protocol import Drafter, NoneDrafter
from crest.drafters.store import CONNECT_TIMEOUT, RETRY_INTERVAL, StoreDrafter, open_store
from crest.drafters.suffix_array import RestDrafter, RestIndex, check_rest_index
from crest.errors import ConfigError


@dataclass(frozen=True)
class _Kind:
    """What a drafter name needs and how it is built from that part."""

    part: str | None  # "store", "rest_index" or None
    build: Callable[[Any], Drafter]


_KINDS = {
    "none": _Kind(None, lambda _: NoneDrafter()),
    "prompt": _Kind(None, lambda _: PromptDrafter()),
    "rest": _Kind("rest_index", RestDrafter),
    "crest": _Kind("store", StoreDrafter),
    "crest+prompt": _Kind("store", lambda store: MergedDrafter(StoreDrafter(store), PromptDrafter())),
}

NAMES = tuple(_KINDS)

_NEEDS = {
    "store": "--store NAME",
    "rest_index": "--rest-index DIR (build one with `crest rest-index build`)",
}


def check_drafter(name: str, *, store: str | None = None, rest_index: str | Path | None = None) -> str:
    """Return the drafter's canonical name once it and the part it needs are given; raise ConfigError if not.

    Opens nothing: the store name must be an identifier (InvalidName otherwise) and the REST index a directory
    holding one.
    """
    key, kind = _kind(name)
    if kind.part == "store":
        if not store:
            raise _missing(key, kind)
        check_store_name(store)
    elif kind.part == "rest_index":
        if not rest_index:
            raise _missing(key, kind)
        check_rest_index(rest_index)
    return key


def make_drafter(name: str, *, store: Any = None, rest_index: Any = None) -> Drafter:
    """Return the drafter called `name` built on parts already open.

    `store` is a `crest_client.Store` (or anything with its `draft` method); `rest_index` a `RestIndex` or the
    directory of a saved one. A part the drafter does not need is ignored.
    """
    key, kind = _kind(name)
    part = {"store": store, "rest_index": rest_index}.get(kind.part or "")
    if kind.part is not None and part is None:
        raise _missing(key, kind)
    if kind.part == "rest_index" and isinstance(part, str | Path):
        part = RestIndex.load(part)
    return kind.build(part)


def open_drafter(
    name: str,
    *,
    store: str | None = None,
    rest_index: str | Path | None = None,
    dsn: str | None = None,
    fingerprint: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    retry_interval: float = RETRY_INTERVAL,
) -> Drafter:
    """Return the drafter `name` with its store or REST index opened.

    A database that does not answer is said once (a warning) and costs store drafts only, until it answers
    (tried every `retry_interval` seconds in the background); a missing store or a store built with another
    tokenizer than `fingerprint` raises StoreNotFound or FingerprintMismatch.
    """
    key = check_drafter(name, store=store, rest_index=rest_index)
    kind = _KINDS[key]
    part = None
    if kind.part == "store":
        assert store is not None  # checked above
        part = open_store(
            store, dsn=dsn, fingerprint=fingerprint, connect_timeout=connect_timeout, retry_interval=retry_interval
        )
    elif kind.part == "rest_index":
        assert rest_index is not None
        part = RestIndex.load(rest_index)
    return kind.build(part)


def _kind(name: str) -> tuple[str, _Kind]:
    key = (name or "").strip().lower()
    if key not in _KINDS:
        raise ConfigError(f"unknown drafter {name!r}: use one of {', '.join(NAMES)}")
    return key, _KINDS[key]


def _missing(key: str, kind: _Kind) -> ConfigError:
    return ConfigError(f"--drafter {key} needs {_NEEDS[kind.part or '']}")
