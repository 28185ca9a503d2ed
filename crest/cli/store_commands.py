"""Commands that build and read stores: `crest ingest`, `lookup`, `stores` and `drop`.

Commands that write (`ingest`, `drop`) migrate the schema first (safe to run many times). Commands that only read
(`lookup`, `stores`, `db query`, `export`) never do: a read-only role or a replica must work, so they check the
schema's revision and say in one line when it is missing (exit 1: no store there) or at another revision than
this crest's (exit 3: `crest db upgrade`), never a raw SQL error.
"""

from __future__ import annotations

from typing import Annotated

import typer

from crest.cli.options import Dsn, Format, Inputs, Json, Keep, StoreName, SuffixJudge, SuffixRule, Tokenizer
from crest.config import DEFAULT_DENSE_PRECISION, DEFAULT_SUFFIX_RULE, DEFAULT_TOP_T, check_store_name, check_text


def database(dsn: str | None) -> str:
    """Return the DSN in use (option/env, else the embedded server, started) with crest's schema migrated."""
    from crest import db
    from crest.config import resolve_dsn

    url = resolve_dsn(dsn)
    db.upgrade(url)
    return url


def read_database(dsn: str | None, *, store: str | None = None) -> str:
    """Return the DSN in use for a command that only reads: its crest schema checked, never migrated.

    No crest schema is StoreNotFound (naming `store` when given); a schema at another revision than this crest's
    is a DatabaseError that names `crest db upgrade`.
    """
    from crest.config import resolve_dsn
    from crest.db.connection import head_revision, schema_revision
    from crest.errors import DatabaseError, StoreNotFound

    url = resolve_dsn(dsn)
    revision = schema_revision(url)
    if revision is None:
        what = f"no published store named {store!r}" if store else "no store"
        raise StoreNotFound(f"{what}: the database has no crest schema (crest ingest or crest db upgrade makes it)")
    head = head_revision()
    if revision != head:
        raise DatabaseError(
            f"the database's crest schema is at revision {revision}, this crest reads {head}: `crest db upgrade` "
            "(as the schema's owner, on the primary) migrates one that is behind; one ahead needs a newer crest"
        )
    return url


def ingest(
    ctx: typer.Context,
    inputs: Inputs,
    store: StoreName,
    tokenizer: Tokenizer,
    fmt: Format = "auto",
    weight: Annotated[
        list[str] | None,
        typer.Option(
            metavar="INPUT=K",
            help="Read INPUT (one of the inputs, as given) K times, so its n-grams count K times (repeatable): "
            "the model's own answers (crest answer) among human text draft best weighted up.",
        ),
    ] = None,
    max_n: Annotated[int, typer.Option(envvar="CREST_MAX_N", help="Largest n-gram length.")] = 4,
    top_t: Annotated[
        int | None,
        typer.Option(
            help=f"Keep the T most common n-grams of each n (default {DEFAULT_TOP_T:,} when no --budget). A store "
            "can hold a few less: an n-gram whose every occurrence ends its document has no continuation, so no "
            "tree, and is not stored; and an n with fewer than T distinct n-grams keeps them all. Of those, "
            "--suffix-rule prune (the default) keeps only the rows a lookup would draft from.",
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            help="Largest T whose store fits this size on disk as `crest stores` reports it (its rows left after "
            "pruning, their hash index, its token table), e.g. 200MB."
        ),
    ] = None,
    continuation_length: Annotated[int, typer.Option(help="Tokens of continuation per occurrence.")] = 10,
    max_matches: Annotated[int, typer.Option(help="Occurrences sampled per n-gram at most.")] = 5000,
    tree_size: Annotated[int, typer.Option(envvar="CREST_TREE_SIZE", help="Nodes kept per tree.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed of the occurrence sampling.")] = 0,
    selection: Annotated[str, typer.Option(help="combined (top-t of each n), single or upto.")] = "combined",
    single_n: Annotated[int | None, typer.Option(help="The n for --selection single.")] = None,
    keep: Keep = "count",
    suffix_rule: SuffixRule = DEFAULT_SUFFIX_RULE,
    suffix_judge: SuffixJudge = None,
    blob_format: Annotated[
        int,
        typer.Option(envvar="CREST_BLOB_FORMAT", help="Tree blobs: 2 compact, 1 larger but faster to decode."),
    ] = 2,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
    chunk_tokens: Annotated[
        int, typer.Option(envvar="CREST_CHUNK_TOKENS", help="Corpus positions scanned at once (bounds peak memory).")
    ] = 1 << 22,
    engine: Annotated[
        str,
        typer.Option(
            envvar="CREST_ENGINE",
            help="inprocess (this process) or spark (Apache Spark: needs pip install 'crest[spark]' and Java; "
            "also reads Parquet and any path Spark reads). Both publish the same rows.",
        ),
    ] = "inprocess",
    spark_master: Annotated[
        str | None, typer.Option(envvar="CREST_SPARK_MASTER", help="Spark master URL (default local[*]).")
    ] = None,
    spark_partitions: Annotated[
        int | None,
        typer.Option(envvar="CREST_SPARK_PARTITIONS", help="Token partitions (default: Spark's default parallelism)."),
    ] = None,
    dense_model: Annotated[
        str | None,
        typer.Option(
            envvar="CREST_DENSE_MODEL",
            help="Also build a dense part (DReSD): this model's last hidden states at sampled corpus positions, "
            "in pgvector, for --drafter dense, crest+dense and crest+dense+prompt (the model they generate with).",
        ),
    ] = None,
    dense_dims: Annotated[int, typer.Option(help="Dense vector dimensions after PCA.")] = 64,
    dense_positions: Annotated[int, typer.Option(help="Corpus positions sampled for the dense part.")] = 200_000,
    dense_continuation: Annotated[
        int, typer.Option(help="Tokens stored after each dense position (the first is the one it predicted).")
    ] = 16,
    dense_index: Annotated[
        str,
        typer.Option(
            help="ANN index of the dense part: ivfflat (about 50 rows a list, at most 2,000 lists; a query scans 1% "
            "of the lists and at least about 1,000 rows: the cheaper batch lookup) or hnsw (m 16, ef_search 100)."
        ),
    ] = "ivfflat",
    dense_precision: Annotated[
        str,
        typer.Option(
            envvar="CREST_DENSE_PRECISION",
            help="Vector precision of the dense part: half (pgvector halfvec, float16: half the vector bytes, "
            "a cheaper batch lookup, recall@16 within 0.01) or single (vector, float32).",
        ),
    ] = DEFAULT_DENSE_PRECISION,
    dense_device: Annotated[
        str,
        typer.Option(
            envvar="CREST_DENSE_DEVICE",
            help="Where the dense part's model runs: cpu or cuda[:N] (float32 either way; an H200 embeds ~175x "
            "faster than 2 CPU cores).",
        ),
    ] = "cpu",
    dense_batch: Annotated[
        int, typer.Option(help="Windows of 512 tokens per forward of the dense build (64 suits a GPU).")
    ] = 8,
    dsn: Dsn = None,
) -> None:
    """Tokenize a corpus, keep its most common n-grams with their continuation trees, publish a store.

    The new version replaces the store's published one atomically; a failed or interrupted ingest leaves the
    previous version in place. Version numbers are shared by all stores of a database (they are row ids), so
    a store's versions need not be consecutive.
    """
    from crest.cli.display import RichReporter, print_summary
    from crest.config import IngestOptions, parse_size, resolve_dsn
    from crest.errors import ConfigError
    from crest.ingest.corpus import weigh_inputs
    from crest.ingest.pipeline import ingest as run_ingest
    from crest.ingest.publishing import check_ingest, check_judge

    options = IngestOptions(
        max_n=max_n,
        top_t=top_t,
        budget=parse_size(budget) if budget is not None else None,
        continuation_length=continuation_length,
        max_matches=max_matches,
        tree_size=tree_size,
        seed=seed,
        selection=selection,
        single_n=single_n,
        blob_format=blob_format,
        keep=keep,
        suffix_rule=suffix_rule,
    )
    options = check_ingest(options, store=store, engine=engine, chunk_tokens=chunk_tokens, partitions=spark_partitions)
    check_judge(options, judged=bool(suffix_judge), engine=engine)
    inputs = weigh_inputs(inputs, weight or [])
    dense = None
    given = [f"--{name.replace('_', '-')}" for name in _DENSE_OPTIONS if _given(ctx, name)]
    if dense_model is None and given:  # a value that would be ignored: the user meant a dense part
        raise ConfigError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --dense-model")
    if dense_model is not None:
        from crest.ingest.dense import DenseOptions

        dense = DenseOptions(
            dense_model,
            dims=dense_dims,
            positions=dense_positions,
            continuation=dense_continuation,
            engine=engine,
            index=dense_index,
            precision=dense_precision,
            device=dense_device,
            batch=dense_batch,
        ).validate()
    if engine == "spark":
        from crest.ingest.spark import ingest_spark

        with RichReporter(enabled=not quiet) as reporter:
            built = ingest_spark(
                inputs,
                store=store,
                tokenizer=tokenizer,
                dsn=resolve_dsn(dsn),
                options=options,
                fmt=fmt,
                master=spark_master,
                partitions=spark_partitions,
                reporter=reporter,
                chunk_tokens=chunk_tokens,
                judge=suffix_judge or (),
            )
        print_summary(built)
        return
    with RichReporter(enabled=not quiet) as reporter:
        summary = run_ingest(
            inputs,
            store=store,
            tokenizer=tokenizer,
            dsn=resolve_dsn(dsn),
            options=options,
            fmt=fmt,
            reporter=reporter,
            chunk_tokens=chunk_tokens,
            dense=dense,
            judge=suffix_judge or (),
        )
    print_summary(summary)


_DENSE_OPTIONS = (
    *("dense_dims", "dense_positions", "dense_continuation", "dense_index", "dense_precision"),
    *("dense_device", "dense_batch"),
)


def _given(ctx: typer.Context, name: str) -> bool:
    """Return whether option `name` was set on the command line or by its environment variable."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def lookup(
    text: Annotated[str, typer.Argument(metavar="TEXT", help="Text whose end is looked up.")],
    store: StoreName,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", "-t", help="Default: the tokenizer the store was built with.")
    ] = None,
    max_nodes: Annotated[int, typer.Option(help="Nodes of the tree to show.")] = 64,
    rule: Annotated[
        str | None,
        typer.Option(
            envvar="CREST_SUFFIX_RULE",
            show_envvar=True,
            help="Which stored suffix of TEXT drafts: expected (default; the one whose tree's first token is most "
            "likely right, often a short, common suffix) or longest (the longest stored suffix).",
        ),
    ] = None,
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Show the draft tree stored for a suffix of TEXT: the suffix the rule picks, where its tree came from, the tree.

    The SDK drafts the same way (`Store.connect(rule=...)`); --rule longest shows the longest stored suffix's tree.
    A store built with --suffix-rule backoff decided each row's tree at ingest (its own merged with its suffixes'):
    the longest stored suffix matches whatever the rule, and the line `tree:` names the suffixes it backed off to.
    One built with --suffix-rule prune kept only the rows the expected rule can choose: its longest stored suffix
    is the expected rule's choice, whatever --rule says.
    """
    from crest_client.choice import resolve_rule

    from crest.cli.display import print_draft
    from crest.drafters.text_lookup import lookup_text
    from crest.errors import ConfigError, CrestClientError

    try:
        rule = resolve_rule(rule)
    except CrestClientError as exc:
        raise ConfigError(f"--rule: {exc}") from None
    if max_nodes < 1:
        raise ConfigError(f"--max-nodes must be at least 1, got {max_nodes}")
    found = lookup_text(
        read_database(dsn, store=store),
        store,
        check_text(text, name="TEXT"),
        tokenizer=tokenizer,
        max_nodes=max_nodes,
        rule=rule,
    )
    print_draft(found, as_json=as_json)


def stores(
    show_all: Annotated[
        bool, typer.Option("--all", help="Also versions being built, retired (replaced) or failed.")
    ] = False,
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """List the stores with their figures and disk use (and the bytes of what each learned).

    Each ingest makes a new version: `building` while it runs, `published` once it is the one lookups read,
    `retired` when a newer version replaced it (removed by the next ingest), `failed` when its ingest failed or
    was interrupted (its tables are removed; the previous version stayed published). Version numbers are shared
    by all stores of a database. A store has a `static` version (its ingest) and, once `crest refresh` or a
    server built one from what it served, a `live` version.
    """
    from crest import db
    from crest.cli.display import print_stores

    with db.session(read_database(dsn)) as conn:
        rows = db.list_stores(conn, include_all=show_all)
    print_stores(rows, as_json=as_json, show_state=show_all)


def drop(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Store to drop.")],
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")
    ] = False,
    dsn: Dsn = None,
) -> None:
    """Drop a store: its published static and live versions and what it learned (asks first, unless --yes)."""
    import sys

    from crest import db
    from crest.errors import ConfigError, StoreNotFound

    url = database(dsn)
    check_store_name(name)
    with db.session(url) as conn:
        versions = [row for row in db.list_stores(conn) if row["name"] == name]
    if not any(row["tier"] == "static" for row in versions):
        raise StoreNotFound(f"no published store named {name!r}")
    if not yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"crest drop {name} asks for confirmation and stdin is not a terminal: add --yes")
        learned = max(int(row["learned_rows"] or 0) for row in versions)
        what = ", ".join(f"{row['tier']} version {row['id']}" for row in versions)
        typer.confirm(f"Drop store {name!r} ({what}) and its {learned:,} learned rows?", abort=True)
    with db.session(url) as conn:
        sid = db.drop_store(conn, name)
    typer.echo(f"dropped store {name!r} (version {sid})")
