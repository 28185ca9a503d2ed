"""The one registry of drafter names: `none`, `prompt`, `rest`, `crest`, `crest+prompt`, and any `register`ed.

Each name is a `Kind`: the parts it is built on (nothing, a store, or a REST index), where it may run
(`generate`, `serve` per request, `bench`, the `vllm` proposer) and a builder taking those parts once open.
`check_drafter` checks a name, where it runs and the names of its parts without opening anything, so a command
can refuse bad options before it loads a model; `make_drafter` builds a drafter on parts already open (a
benchmark's store handles, a server's per-row store lease); `open_drafter` opens the parts first (a store
through the SDK, which drafts nothing while the database is down, or a REST index from disk) and `close_drafter`
closes what it opened. Every command, benchmark, the server and the vLLM proposer go through here, so a new
drafter is one `register` call; the parts a drafter reports for learning's statistics come from the drafter
itself (`drafted_parts`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crest.drafters.lease  # noqa: F401  (registers the part "store")
from crest.decoding.drafter import Drafter, NoneDrafter
from crest.drafters.merged import MergedDrafter
from crest.drafters.parts import part_names, part_of
from crest.drafters.prompt import PromptDrafter
from crest.drafters.store import CONNECT_TIMEOUT, RETRY_INTERVAL, StoreDrafter
from crest.drafters.suffix_array import RestDrafter, RestIndex
from crest.errors import ConfigError

WHERE = ("generate", "serve", "bench", "vllm")  # the places a drafter may run
_OWN = "crest."  # the package prefix of the modules whose kinds are crest's own (`crest_names`)


@dataclass(frozen=True)
class Kind:
    """A drafter name: the parts it is built on, where it may run, and how it is built from those parts opened."""

    name: str
    needs: tuple[str, ...]  # parts, each a registered `crest.drafters.parts.Part`: "store", "rest_index", ...
    build: Callable[[dict[str, Any]], Drafter]  # {need: opened part} -> drafter
    runs: frozenset[str] = frozenset(WHERE)  # where it may run: generate, serve (per request), bench, vllm
    summary: str = ""  # one line for --help
    fallback: str = "none"  # the kind that drafts instead when a part it needs cannot be used (`usable_kind`)


_KINDS: dict[str, Kind] = {}
# drafter -> the parts open_drafter opened for it (its owner closes them with close_drafter); a drafter built on
# parts its caller opened (make_drafter) is not here: closing those is the caller's
_OPENED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def register(kind: Kind) -> None:
    """Add a drafter name (ConfigError if the name is taken or it needs a part the registry cannot open)."""
    unknown = [need for need in kind.needs if need not in part_names()]
    if kind.name in _KINDS or unknown or not set(kind.runs) <= set(WHERE):
        raise ConfigError(f"cannot register drafter {kind.name!r}: taken, or unknown parts {unknown} or places")
    _KINDS[kind.name] = kind


def names(where: str | None = None) -> tuple[str, ...]:
    """Return the drafter names, in registration order; with `where`, those that may run there."""
    return tuple(name for name, kind in _KINDS.items() if where is None or where in kind.runs)


def crest_names(where: str | None = None) -> tuple[str, ...]:
    """Return the drafter names crest itself registers, in registration order: `names` less those registered from
    outside crest (a plugin's, a test's toy kind).

    A kind is crest's when its builder is defined in a crest module: here, or in a kind's own module (the dense
    kinds register from `crest.drafters.dense`, which `crest.drafters` imports before anyone can call this).
    """
    return tuple(name for name in names(where) if _KINDS[name].build.__module__.startswith(_OWN))


def kind_of(name: str) -> Kind:
    """Return the registered kind called `name` (case and spaces ignored; ConfigError if there is none)."""
    return _kind(name)[1]


def needs_store(name: str) -> bool:
    """Return whether the kind `name` is built on a part of a store (the store itself, its dense part, ...)."""
    return any(part_of(need).named_by == "store" for need in kind_of(name).needs)


def usable_kind(name: str, missing: set[str] | frozenset[str]) -> str:
    """Return the kind that drafts for `name` when the parts in `missing` cannot be used (its fallbacks, in turn)."""
    key, kind = _kind(name)
    seen = {key}
    while missing & set(kind.needs):
        key, kind = _kind(kind.fallback)
        if key in seen:
            raise ConfigError(f"drafter {name!r}: its fallbacks loop at {key!r}")
        seen.add(key)
    return key


def describe(where: str | None = None) -> str:
    """Return the drafter names that may run at `where` for a help text: "none, prompt, ... or crest+prompt"."""
    found = names(where)
    return ", ".join(found[:-1]) + (" or " if len(found) > 1 else "") + found[-1]


register(Kind("none", (), lambda _: NoneDrafter(), summary="no draft: plain decoding"))
register(Kind("prompt", (), lambda _: PromptDrafter(), summary="prompt lookup in the request's own text"))
register(
    Kind(
        "rest",
        ("rest_index",),
        lambda parts: RestDrafter(parts["rest_index"]),
        runs=frozenset({"generate", "bench"}),  # an index in one process's memory: not per request or in vLLM
        summary="REST over a suffix array of a corpus",
    )
)
register(Kind("crest", ("store",), lambda parts: StoreDrafter(parts["store"]), summary="the store's tree"))
register(
    Kind(
        "crest+prompt",
        ("store",),
        lambda parts: MergedDrafter(StoreDrafter(parts["store"]), PromptDrafter()),
        summary="the store's tree merged with prompt lookup",
        fallback="prompt",
    )
)


def check_drafter(
    name: str, *, where: str | None = None, store: str | None = None, rest_index: str | Path | None = None
) -> str:
    """Return the drafter's canonical name once it may run `where` and its parts are given; raise ConfigError if not.

    Opens nothing: the store name must be an identifier (InvalidName otherwise) and the REST index a directory
    holding one.
    """
    key, kind = _kind(name, where)
    given = {"store": store, "rest_index": rest_index}
    for need in kind.needs:
        part = part_of(need)
        value = given[part.named_by]
        if not value:
            raise _missing(key, need)
        if part.check is not None:
            part.check(str(value))
    return key


def make_drafter(name: str, **parts: Any) -> Drafter:
    """Return the drafter called `name` built on parts already open, given by part name.

    `store` is a `crest_client.Store` (or anything with its `draft` method); `rest_index` a `RestIndex` or the
    directory of a saved one; `dense_index` a `crest.drafters.dense_index.DenseIndex`; another registered part
    what its `open` returns (or a row's view of it). A part the drafter does not need is ignored.
    """
    key, kind = _kind(name)
    built: dict[str, Any] = {}
    for need in kind.needs:
        if parts.get(need) is None:
            raise _missing(key, need)
        built[need] = parts[need]
    if isinstance(built.get("rest_index"), str | Path):
        built["rest_index"] = RestIndex.load(built["rest_index"])
    return kind.build(built)


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
    given = {"store": store, "rest_index": rest_index}
    parts: dict[str, Any] = {}
    opened: list[Any] = []  # what holds connections: closed by close_drafter, or here when a later part fails
    try:
        for need in kind.needs:
            part = part_of(need)
            parts[need] = part.open(
                str(given[part.named_by]),
                dsn=dsn,
                fingerprint=fingerprint,
                connect_timeout=connect_timeout,
                retry_interval=retry_interval,
            )
            if callable(getattr(parts[need], "close", None)):
                opened.append(parts[need])
        drafter = kind.build(parts)
    except BaseException:
        _close_all(opened)
        raise
    if opened:
        _OPENED[drafter] = opened
    return drafter


def close_drafter(drafter: Drafter) -> None:
    """Close the parts that `open_drafter` opened for `drafter` (a no-op for any other drafter)."""
    _close_all(_OPENED.pop(drafter, []))


def _close_all(parts: list[Any]) -> None:
    for part in reversed(parts):
        part.close()


def _kind(name: str, where: str | None = None) -> tuple[str, Kind]:
    key = (name or "").strip().lower()
    kind = _KINDS.get(key)
    if kind is None or (where is not None and where not in kind.runs):
        at = f" here ({where})" if where is not None and kind is not None else ""
        raise ConfigError(f"unknown drafter {name!r}{at}: use one of {', '.join(names(where))}")
    return key, kind


def _missing(key: str, need: str) -> ConfigError:
    return ConfigError(f"--drafter {key} needs {part_of(need).option}")
