"""Reports of `crest bench accept`: the markdown tables and the PNG plots written beside `accept.json`.

Plots use matplotlib's Agg backend (no display); `write_plots` returns the files it wrote, or none with a note
when matplotlib is missing (`pip install 'crest[bench]'`), so a run never fails for want of a plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Return the markdown lines of the drafter x datastore table."""
    lines = [
        "| drafter | datastore | size param | bytes | M (replay) | M (real) | tokens/s | speedup vs none "
        "| draft ms median / p99 | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        real = r.get("real") or {}
        param = _param(r)
        lines.append(
            f"| {r['drafter']} | {r['datastore'] or '-'} | {param} | {_size(r['bytes']) if r['bytes'] else '-'} "
            f"| {r['mean_accepted_length']:.3f} | {_num(real.get('mean_accepted_length'), 3)} "
            f"| {_num(real.get('tokens_per_second'), 1)} | {_num(real.get('speedup'))} "
            f"| {r['draft_ms_median']:.2f} / {r['draft_ms_p99']:.2f} | {real.get('exact', '-')} |"
        )
    return lines


def _param(r: dict[str, Any]) -> str:
    """Return a row's size parameter: REST's percent, crest's top-t, a dense part's positions, or both."""
    found = [f"{r['percent']:g}%"] if r.get("percent") else []
    found += [f"t={r['top_t']:,}"] if r.get("top_t") else []
    found += [f"p={r['positions']:,}"] if r.get("positions") else []
    return " + ".join(found) or "-"


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """Write the run's tables (main comparison, targets, cross-check, ablations) as markdown."""
    lines = [
        f"# crest bench accept: {results['setting']} ({results['model']}, {results['prompts']} prompts, "
        f"{results['options']['max_new_tokens']} new tokens)",
        "",
        f"Command: `{results.get('command') or '-'}`",
        "",
        f"M (replay): {results['method']['mean_accepted_length']}. Real: {results['method']['real']}.",
        "",
        *main_table(results["rows"]),
        "",
    ]
    cmp = results.get("comparison") or {}
    if cmp:
        ratio = cmp["storage_ratio_at_rest_best"]
        lines += [
            f"- REST's best M {cmp['rest_best_m']:.3f} at {_size(cmp['rest_best_bytes'])}; crest's best "
            f"M {cmp['crest_best_m']:.3f}.",
            "- Storage to match REST's best: "
            + (f"{_size(cmp['crest_bytes_matching_rest_best'])}, {ratio:.1f}x less" if ratio else "not reached")
            + ".",
            "- Gain at equal storage (crest interpolated in log bytes): "
            + (", ".join(f"{_size(g['bytes'])}: {100 * g['gain']:+.1f}%" for g in cmp["equal_storage"]) or "no overlap")
            + ".",
            "",
        ]
    dense = results.get("dense_comparison") or {}
    if dense:
        lines += [
            "- dense against REST at equal bytes (dense interpolated in log bytes): "
            + (
                ", ".join(f"{_size(g['bytes'])}: {100 * g['gain']:+.1f}%" for g in dense["equal_storage"])
                or "no overlap"
            )
            + f" (above REST at every size: {'yes' if dense['above_everywhere'] else 'no'}).",
            "",
        ]
    if results.get("crosscheck"):
        lines += [
            "Cross-check (replay against the real loop with a fixed tree size):",
            "",
            "| prompt | drafter | datastore | replay steps | real steps | equal | output identical |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {c['prompt']} | {c['drafter']} | {c['variant'] or '-'} | {c['replay_steps']} "
            f"| {c['real_steps']} | {c['equal']} | {c['same_output']} |"
            for c in results["crosscheck"]
        ]
        lines.append("")
    abl = results.get("ablations")
    if abl:
        lines += [
            f"Ablations (crest drafter, M by replay over the first {abl['prompts']} prompts):",
            "",
            "| selection | n | top-t | n-grams | bytes | avg tree nodes | M |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, label in (("single", "n ="), ("upto", "n <=")):
            lines += [
                f"| {label} | {c['n']} | {c['top_t']:,} | {c['ngrams']:,} | {_size(c['bytes'])} "
                f"| {c['avg_tree_nodes']:.1f} | {c['mean_accepted_length']:.3f} |"
                for c in abl[mode]
            ]
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Write accepted length against datastore bytes (crest vs REST) and the ablation curves; return the files."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    setting, written = results["setting"], []
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = (("rest", "s-"), ("crest", "o-"), ("crest+prompt", "^--"), ("dense", "D-"))
    for drafter, style in (*curves, ("crest+dense", "v:"), ("crest+dense+prompt", "P--")):
        pts = sorted((r["bytes"], r["mean_accepted_length"]) for r in results["rows"] if r["drafter"] == drafter)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=drafter)
    for drafter, style in (("prompt", ":"), ("none", "-.")):
        flat = [r["mean_accepted_length"] for r in results["rows"] if r["drafter"] == drafter]
        if flat:
            ax.axhline(flat[0], linestyle=style, color="grey", label=f"{drafter} (no datastore)")
    _finish(ax, "datastore bytes", f"{setting}: accepted length vs datastore size", log=True)
    written.append(_save(fig, out / f"accept_{setting}.png", plt))
    abl = results.get("ablations")
    if abl:
        for mode, label, x in (("single", "n = {}", "n-grams stored"), ("upto", "n <= {}", "n-grams stored (all n)")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for n in sorted({c["n"] for c in abl[mode]}):
                pts = sorted((c["ngrams"], c["mean_accepted_length"]) for c in abl[mode] if c["n"] == n)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label.format(n))
            _finish(ax, x, f"{setting}: accepted length, {'single n' if mode == 'single' else 'n <= m'}", log=True)
            written.append(_save(fig, out / f"ablation_{mode}_{setting}.png", plt))
    return written


def _finish(ax: Any, xlabel: str, title: str, *, log: bool) -> None:
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean accepted length M")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path, plt: Any) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _curve(rows: Sequence[dict[str, Any]], drafter: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["drafter"] == drafter), key=lambda r: r["bytes"])


def _equal_storage(rest: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """Return `other`'s M gain over REST at each REST size inside its range (its curve interpolated in log bytes)."""
    gains = []
    xs = np.log([r["bytes"] for r in other])
    ys = np.array([r["mean_accepted_length"] for r in other])
    for r in rest:
        x = np.log(r["bytes"])
        if xs[0] <= x <= xs[-1]:  # interpolate within the measured range only
            m = float(np.interp(x, xs, ys))
            gains.append({"bytes": r["bytes"], "rest_m": r["mean_accepted_length"], f"{label}_m": m})
            gains[-1]["gain"] = m / r["mean_accepted_length"] - 1.0
    return gains


def compare_dense(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return dense's M gain over REST at REST's sizes within dense's byte range (DReSD's claim), {} without both."""
    rest, dense = _curve(rows, "rest"), _curve(rows, "dense")
    if not rest or not dense:
        return {}
    gains = _equal_storage(rest, dense, "dense")
    return {"equal_storage": gains, "above_everywhere": bool(gains) and min(g["gain"] for g in gains) > 0.0}


def compare(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the paper's two figures: storage ratio at REST's best M, and crest's M gain at equal storage."""
    rest, crest = _curve(rows, "rest"), _curve(rows, "crest")
    if not rest or not crest:
        return {}
    best = max(rest, key=lambda r: r["mean_accepted_length"])
    matching = [r for r in crest if r["mean_accepted_length"] >= best["mean_accepted_length"]]
    ratio = best["bytes"] / matching[0]["bytes"] if matching else None
    gains = _equal_storage(rest, crest, "crest")
    return {
        "rest_best_m": best["mean_accepted_length"],
        "rest_best_bytes": best["bytes"],
        "crest_best_m": max(r["mean_accepted_length"] for r in crest),
        "crest_bytes_matching_rest_best": matching[0]["bytes"] if matching else None,
        "storage_ratio_at_rest_best": ratio,
        "equal_storage": gains,
        "min_gain_at_equal_storage": min((g["gain"] for g in gains), default=None),
    }
