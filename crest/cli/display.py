"""Terminal output for the CLI: rich progress bars for ingest stages, tables for summaries and drafts (a `crest
bench` run's report is `crest.cli.bench_display`'s).

Standard output that is not a terminal (a pipe, a file) gets a shape that does not depend on any width: lines are
never wrapped nor cut, and record lists (`crest stores`, `crest db query`) are a title line, a header line and one
line per row, in plain columns two spaces apart, whatever the terminal would have shown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from crest_client.choice import built_rule
from rich import box
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.tree import Tree

if TYPE_CHECKING:
    from crest.drafters.text_lookup import TextLookup
    from crest.ingest.pipeline import IngestSummary

Advance = Callable[[int], None]
_NUMBER = re.compile(r"^-?[\d,.]+( [kMG]?B)?$|^-$")
_UNWRAPPED = 1 << 16  # the width output that is not a terminal is laid out for: no line is ever wrapped or cut


class _Stdout(Console):
    """Standard output: fitted to the terminal on one; piped or redirected, as wide as its longest line."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(_UNWRAPPED, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self.width, self.height = new_size


console = Console(stderr=True)
out = _Stdout()


class RichReporter:
    """Shows one progress bar per ingest stage on stderr."""

    def __init__(self, *, enabled: bool = True) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> RichReporter:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def stage(self, name: str, total: int | None) -> Advance:
        task = self._progress.add_task(name, total=total)
        self._tasks[name] = task
        return lambda advance: self._progress.advance(task, advance)

    def done(self, name: str) -> None:
        task = self._tasks.get(name)
        if task is not None:
            current = self._progress.tasks[task].completed
            self._progress.update(task, total=current, completed=current)


def json_value(value: Any) -> Any:
    """Return `value` as JSON can hold it: SQL numerics and numpy scalars as numbers, anything else as text."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    item = getattr(value, "item", None)  # numpy scalars
    return item() if callable(item) else str(value)


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f} MB"


def print_summary(summary: IngestSummary) -> None:
    """Print an ingest summary: documents, tokens, n-grams per n, bytes and time per stage."""
    head = Table(title=f"store {summary.store!r} published (version {summary.store_id})", show_header=False)
    head.add_row("documents", f"{summary.documents:,} (+{summary.empty_documents:,} empty skipped)")
    if summary.dropped_records:
        head.add_row("records dropped", f"{summary.dropped_records:,}: " + "; ".join(summary.drop_reasons[:3]))
    head.add_row("tokens", f"{summary.tokens:,}")
    head.add_row("top-t", str(summary.top_t))
    head.add_row("n-grams stored", f"{summary.rows:,} (avg tree {summary.avg_tree_nodes:.1f} nodes)")
    head.add_row(
        "bytes on disk",
        f"{_mb(summary.table_bytes + summary.index_bytes)} (table {_mb(summary.table_bytes)}, "
        f"index {_mb(summary.index_bytes)}; {summary.bytes_per_ngram:.0f} B per n-gram)",
    )
    head.add_row("peak memory", _mb(summary.peak_rss_bytes))
    if summary.suffix_choice:
        head.add_row("suffix rule", describe_choice(summary.suffix_choice))
    out.print(head)
    per_n = Table(title="n-grams per n")
    for column in ("n", "counted (unique)", "kept", "positions", "covered by kept"):
        per_n.add_column(column, justify="right")
    for n in sorted(summary.counted):
        pos = summary.positions.get(n, 0)
        cov = summary.covered.get(n, 0)
        share = f" ({100 * cov / pos:.1f}%)" if pos else ""
        per_n.add_row(str(n), f"{summary.counted[n]:,}", f"{summary.kept.get(n, 0):,}", f"{pos:,}", f"{cov:,}{share}")
    out.print(per_n)
    stages = Table(title="time per stage")
    stages.add_column("stage")
    stages.add_column("seconds", justify="right")
    stages.add_column("tokens/s", justify="right")
    for stage, seconds in summary.seconds.items():
        stages.add_row(stage, f"{seconds:.2f}", f"{summary.tokens / seconds:,.0f}" if seconds > 0 else "-")
    stages.add_row("total", f"{sum(summary.seconds.values()):.2f}", "")
    out.print(stages)


def describe_choice(choice: dict[str, Any]) -> str:
    """Return `--suffix-rule auto`'s choice in words: the rule, what it was judged on, both estimates."""
    text = "a held-out 1% of the corpus" if choice.get("judged_on", "held-out") == "held-out" else "--suffix-judge"
    where = "novel positions" if choice.get("novel") else "positions (none novel: every one judged)"
    return (
        f"auto chose {choice['rule']} on {choice['positions']:,} {where} of {text} "
        f"(M estimates: prune {choice['m_prune']:.3f}, longest {choice['m_longest']:.3f})"
    )


def print_draft(found: TextLookup, *, as_json: bool = False) -> None:
    """Print a draft tree with the suffix it matched, the rule that picked it, and each node's text and weight."""
    draft, pieces = found.draft, found.pieces
    if as_json:
        payload = (
            None
            if draft is None
            else {
                "n": draft.n,
                "rule": found.rule,
                "suffix": {"tokens": found.suffix_ids, "text": found.suffix_pieces},
                "source": found.source,
                "tokens": draft.tokens.tolist(),
                "parents": draft.parents.tolist(),
                "weights": draft.weights.tolist(),
                "text": list(pieces),
            }
        )
        out.print_json(json.dumps(payload))
        return
    if draft is None or len(draft) == 0:
        out.print("no stored suffix matches the end of this text")
        return
    suffix = escape(" ".join(repr(p) for p in found.suffix_pieces))
    root = Tree(
        f"[bold]matched suffix {suffix}[/bold] ({draft.n} token(s), rule {found.rule}), {len(draft)} nodes; "
        f"node: text (id, weight)\ntree: {escape(found.source)}"
    )
    nodes: list[Tree] = []
    for i, (parent, weight) in enumerate(zip(draft.parents.tolist(), draft.weights.tolist(), strict=True)):
        label = f"{escape(repr(pieces[i]))} [dim](id {int(draft.tokens[i])}, weight {weight})[/dim]"
        nodes.append((root if parent < 0 else nodes[parent]).add(label))
    out.print(root)


def print_stores(rows: list[dict[str, Any]], *, as_json: bool = False, show_state: bool = False) -> None:
    """Print the stores with their key figures: a table, or one block per store when the terminal is narrow."""
    if as_json:
        out.print_json(json.dumps(rows, default=json_value))
        return
    if not rows:
        out.print("no store yet: run crest ingest")
        return
    columns = ["store", "version", "tier", *(["state"] if show_state else []), "rule", "n-grams", "tokens", "size"]
    columns += ["B/n-gram"]
    columns += ["learned", "published"]
    _print_records("crest stores", columns, [_store_line(row, show_state=show_state) for row in rows])


def _store_line(row: dict[str, Any], *, show_state: bool) -> list[str]:
    figures = row.get("figures") or {}
    kept = sum((figures.get("kept") or {}).values())
    size = int(row["table_bytes"]) + int(row["index_bytes"])
    published: Any = row.get("published_at")
    return [
        str(row["name"]),
        str(row["id"]),
        str(row.get("tier", "static")),
        *([str(row["state"])] if show_state else []),
        _suffix_rule(row),
        f"{kept:,}",
        f"{figures.get('tokens', 0):,}",
        _mb(size),
        f"{size / kept:.0f}" if kept else "-",
        _mb(int(row["learned_bytes"])) if row.get("learned_rows") else "-",  # the store's, on each of its versions
        published.strftime("%Y-%m-%d %H:%M") if published is not None else "-",
    ]


def _suffix_rule(row: dict[str, Any]) -> str:
    """Return the tree each of a version's rows holds (`--suffix-rule`; auto: what it chose)."""
    rule = built_rule(row.get("params"))
    if rule == "auto":
        chosen = ((row.get("figures") or {}).get("suffix_choice") or {}).get("rule")
        return f"auto:{chosen}" if chosen else rule
    return rule


def print_query(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, as_json: bool = False) -> None:
    """Print a query's rows as a table (one block per row when the terminal is narrow), or as JSON lines."""
    if as_json:
        for row in rows:
            print(json.dumps(dict(zip(columns, row, strict=True)), default=json_value), flush=True)
        return
    if not rows:
        out.print(f"{title}: no rows")
        return
    cells = [["-" if v is None else f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    _print_records(title, list(columns), cells)


def _print_records(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """Print rows as a table when it fits the terminal, else as one two-column block per row; nothing is cut.

    Not on a terminal: plain columns (see `plain_records`), the same whatever the width.
    """
    numeric = [all(_NUMBER.match(row[i]) for row in rows) for i in range(len(columns))]
    if not out.is_terminal:
        print("\n".join([title, *plain_records(columns, rows, numeric=numeric)]), flush=True)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, column in enumerate(columns):
        table.add_column(column, no_wrap=True, justify="right" if numeric[i] else "left")
    for row in rows:
        table.add_row(*row)
    out.print(title, style="bold")
    if Measurement.get(out, out.options.update_width(1 << 20), table).maximum <= out.width:
        out.print(table)
        return
    key_width = max(len(c) for c in columns)
    for i, row in enumerate(rows):
        block = Table(title=f"[{i + 1}] {row[0]}", title_justify="left", show_header=False, box=box.SIMPLE)
        block.add_column(no_wrap=True, min_width=key_width)
        block.add_column(overflow="fold")
        for column, value in zip(columns, row, strict=True):
            block.add_row(column, value)
        out.print(block)


def plain_records(columns: Sequence[str], rows: Sequence[Sequence[str]], *, numeric: Sequence[bool]) -> list[str]:
    """Return a header line and one line per row: columns two spaces apart, numbers right-aligned, none cut."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        fitted = (c.rjust(w) if right else c.ljust(w) for c, w, right in zip(cells, widths, numeric, strict=True))
        return "  ".join(fitted).rstrip()

    return [line(columns), *(line(row) for row in rows)]


def print_figures(title: str, figures: dict[str, Any]) -> None:
    """Print a flat dict of benchmark figures as a two-column table."""
    table = Table(title=title, show_header=False)
    for key, value in figures.items():
        table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else str(value))
    out.print(table)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    """Print a list of flat dicts as one table."""
    table = Table(title=title)
    for key in rows[0] if rows else []:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row.values()])
    out.print(table)
