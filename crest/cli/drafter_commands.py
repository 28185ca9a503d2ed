"""`crest drafters`: the registered drafters, what each is built on and where it may run."""

from __future__ import annotations

from crest.cli.options import Json


def drafters(as_json: Json = False) -> None:
    """List the drafters (`--drafter NAME`): what each needs and where it may run (generate, serve, bench, vllm)."""
    from crest.cli.display import print_query
    from crest.drafters.parts import part_of
    from crest.drafters.registry import WHERE, kind_of, names

    rows = []
    for name in names():
        kind = kind_of(name)
        needs = ", ".join(part_of(need).option.split(" (")[0] for need in kind.needs) or "-"
        rows.append((name, needs, ", ".join(w for w in WHERE if w in kind.runs), kind.summary))
    print_query("drafters", ("drafter", "needs", "runs_in", "summary"), rows, as_json=as_json)
