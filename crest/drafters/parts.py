"""The kinds of part drafters are built on (a store, its dense part, a REST index, and any `register_part`ed).

A `Part` says how a command names one (`--store NAME`, `--rest-index DIR`) and checks that name without opening
anything, how it is opened once per process (`open`), the view each row of a batch drafts through (`lease`), and
how the views of a whole batch are looked up at once before the rows draft (`prefetch`: one round trip per shared
part and step, whatever the batch size). The registry (`crest.drafters.registry`) opens and checks parts through
here, `crest.drafting.DraftHub` opens and leases them for `crest serve` and the vLLM proposer, and both of their
batch loops call `prefetch_parts` once per step, so a new kind of part is one module that registers its `Part`
and the drafter `Kind`s built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crest.errors import ConfigError

NAMED_BY = ("store", "rest_index")  # the command options that name a part: --store NAME, --rest-index DIR


@dataclass(frozen=True)
class BatchRow:
    """What a batch's row looks its parts up with: its context, and the hidden state that predicted its last token."""

    context: Sequence[int]
    hidden: np.ndarray | None = None  # [H]; None: unknown this step (no dense search for the row)


@dataclass(frozen=True)
class Part:
    """A kind of part: how it is named and checked, opened once, leased per row and looked up per batch."""

    name: str
    option: str  # how a command gives it, for "--drafter X needs ..." ("--store NAME")
    open: Callable[..., Any]  # (its name or path, *, dsn, fingerprint, connect_timeout, retry_interval) -> opened
    named_by: str = "store"  # the option that names it (NAMED_BY)
    check: Callable[[str], object] | None = None  # raises for a name or path that cannot be it, opening nothing
    lease: Callable[[Any], Any] | None = None  # opened part -> one row's view (None: rows use the opened part)
    # (the batch's row views, their rows, the tree nodes asked per row): hands each view its answer
    prefetch: Callable[[Sequence[Any], Sequence[BatchRow], int], None] | None = None


_PARTS: dict[str, Part] = {}


def register_part(part: Part) -> None:
    """Add a kind of part (ConfigError if the name is taken or its naming option is not one of NAMED_BY)."""
    if part.name in _PARTS or part.named_by not in NAMED_BY:
        raise ConfigError(f"cannot register part {part.name!r}: taken, or named by {part.named_by!r}")
    _PARTS[part.name] = part


def part_of(name: str) -> Part:
    """Return the registered part called `name` (ConfigError if there is none)."""
    found = _PARTS.get(name)
    if found is None:
        raise ConfigError(f"unknown drafter part {name!r}: one of {', '.join(_PARTS)}")
    return found


def part_names() -> tuple[str, ...]:
    """Return the registered parts' names, in registration order."""
    return tuple(_PARTS)


def lease_part(name: str, opened: Any) -> Any:
    """Return one row's view of the opened part `name` (the part itself when its kind has no lease)."""
    part = part_of(name)
    return part.lease(opened) if part.lease is not None else opened


def prefetch_parts(rows: Sequence[tuple[Mapping[str, Any], BatchRow]], *, max_nodes: int) -> None:
    """Look up every row's part views for the batch before the rows draft: one `prefetch` per kind of part.

    `rows`: each row's views by part name (what its drafter was built on) and what it looks them up with.
    """
    batches: dict[str, tuple[list[Any], list[BatchRow]]] = {}
    for leases, row in rows:
        for name, lease in leases.items():
            views, inputs = batches.setdefault(name, ([], []))
            views.append(lease)
            inputs.append(row)
    for name, (views, inputs) in batches.items():
        prefetch = part_of(name).prefetch
        if prefetch is not None:
            prefetch(views, inputs, max_nodes)
