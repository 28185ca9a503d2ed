"""Options shared by several commands, declared once: each reads its `CREST_<NAME>` environment variable.

Precedence, for every command: the option on the command line > the `CREST_*` variable > the default shown
in `--help`. The database adds one step: `--dsn` > `CREST_DATABASE_URL` > the embedded default server; readers
(generate, serve, bench lookup) use `--read-dsn` > `CREST_READ_DATABASE_URL` > that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Dsn = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        envvar="CREST_DATABASE_URL",
        show_envvar=True,
        help="PostgreSQL DSN; default: the embedded server (`crest db url` prints the one in use).",
    ),
]
ReadDsn = Annotated[
    str | None,
    typer.Option(
        "--read-dsn",
        envvar="CREST_READ_DATABASE_URL",
        show_envvar=True,
        help="PostgreSQL DSN that lookups read from (a replica, or several: host=a,b port=p,q); default: --dsn.",
    ),
]
StoreName = Annotated[
    str, typer.Option("--store", "-s", envvar="CREST_STORE", show_envvar=True, help="Store name (an identifier).")
]
OptionalStore = Annotated[
    str | None,
    typer.Option("--store", "-s", envvar="CREST_STORE", show_envvar=True, help="Store of the crest drafters."),
]
Model = Annotated[
    str,
    typer.Option(
        "--model", "-m", envvar="CREST_MODEL", show_envvar=True, help="HF model dir/name, a .gguf file, or smollm2."
    ),
]
Device = Annotated[str, typer.Option("--device", envvar="CREST_DEVICE", show_envvar=True, help="cpu or cuda.")]
Dtype = Annotated[
    str,
    typer.Option("--dtype", envvar="CREST_DTYPE", show_envvar=True, help="float32, float16, bfloat16 or auto."),
]
MaxNewTokens = Annotated[
    int,
    typer.Option(
        "--max-new-tokens", envvar="CREST_MAX_NEW_TOKENS", show_envvar=True, help="Tokens to generate per prompt."
    ),
]
Chat = Annotated[
    bool,
    typer.Option("--chat", envvar="CREST_CHAT", show_envvar=True, help="Apply the model's chat template."),
]
MaxDraftTokens = Annotated[
    int | None,
    typer.Option(
        "--max-draft-tokens",
        envvar="CREST_MAX_DRAFT_TOKENS",
        show_envvar=True,
        help="Draft tokens verified per forward, at most (0: no drafts). Default: adaptive, the size that maximises "
        "expected tokens/s under the model's measured forward cost (calibrated once per model, device, dtype and "
        "threads, cached in CREST_HOME). On a CPU a forward of more tokens costs more, so when no draft is likely "
        "to pay it drafts nothing and M (tokens per forward) is exactly 1.0.",
    ),
]
Json = Annotated[
    bool,
    typer.Option(
        "--json",
        envvar="CREST_JSON",
        show_envvar=True,
        help="Print JSON: one object per line where there are several (`crest stores`: one array).",
    ),
]
Out = Annotated[
    Path | None, typer.Option("--out", "-o", help="Also write <benchmark>.json and <benchmark>.md into this folder.")
]
Tokenizer = Annotated[
    str,
    typer.Option(
        "--tokenizer",
        "-t",
        envvar="CREST_TOKENIZER",
        show_envvar=True,
        help="HF tokenizer dir/name, a .gguf file, or smollm2.",
    ),
]
Format = Annotated[str, typer.Option("--format", help="auto, sharegpt, jsonl or files.")]
Inputs = Annotated[list[str], typer.Argument(metavar="INPUTS", help="Files, directories or globs to read.")]
SuffixRule = Annotated[
    str,
    typer.Option(
        "--suffix-rule",
        envvar="CREST_BUILD_SUFFIX_RULE",
        show_envvar=True,
        help="The tree each stored n-gram's row holds: prune (its own, kept only where the client's expected rule "
        "would draft from it: a lookup fetches one row and drafts what expected drafts on every row, in a "
        "fraction of the bytes), lookup (every row, its own tree; the client's suffix rule chooses among a "
        "context's stored suffixes at each lookup, fetched together), backoff (its own tree merged with its "
        "suffixes', as n-gram models back off, so a lookup fetches one row) or auto (prune, or every row read "
        "by its longest suffix, whichever drafts better on a held-out 1% of the corpus, at the positions whose "
        "surrounding text the rest never holds verbatim; chosen by a trial build without that 1%, then built from "
        "the whole corpus; or on --suffix-judge, which --engine spark needs). With --budget, prune fills the "
        "budget with the rows it keeps, and auto compares the two rules at equal bytes and fills it the chosen "
        "rule's way (in process only).",
    ),
]
SuffixJudge = Annotated[
    list[str] | None,
    typer.Option(
        "--suffix-judge",
        envvar="CREST_BUILD_SUFFIX_JUDGE",
        show_envvar=True,
        help="With --suffix-rule auto: documents to choose the rule on (a file, directory or glob; its format "
        "detected; repeatable) instead of a held-out 1% of the corpus: text like what the model will write, best "
        "its own answers (crest answer --answers-only). One build, no trial build.",
    ),
]
Keep = Annotated[
    str,
    typer.Option(
        "--keep",
        envvar="CREST_KEEP",
        show_envvar=True,
        help="Which n-grams to keep: count (the most common), savings (occurrences x expected accepted length of "
        "their tree, chosen from trees built for 3x as many) or marginal (savings over the (n-1)-suffix's tree).",
    ),
]
