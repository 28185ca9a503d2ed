"""What one `crest bench accept` run measures (`AcceptOptions`) and the checks of those options.

Drafters, REST sizes, crest top-t values and keeping rules, the dense parts (`dense_positions`: one dense datastore
per count of embedded positions, from the run's corpus or `dense_corpus`; the hybrids pair each with the crest store
of top-t `dense_top_t`), prompts and lengths, timing, ablations. The CLI fills it; `validate` names the first bad
value (ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass

from crest.config import DEFAULT_DENSE_PRECISION, DEFAULT_SUFFIX_RULE, KEEP_RULES, IngestOptions
from crest.db.dense import PRECISIONS
from crest.drafters.registry import names
from crest.errors import ConfigError
from crest.ingest.corpus import weigh_inputs
from crest.ingest.publishing import check_judge

SETTINGS = ("chat", "code")
REST_PERCENTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0)
TIMING = ("all", "largest", "none")
DRAFTERS = ("none", "prompt", "rest", "crest", "crest+prompt")  # the default rows (dense ones are asked for)
DENSE_DRAFTERS = ("dense", "crest+dense", "crest+dense+prompt")  # the rows that need a dense datastore


@dataclass(frozen=True)
class AcceptOptions:
    """What one `crest bench accept` run measures."""

    setting: str | None = None  # chat | code: fills corpus, prompts and hold-out
    corpus: tuple[str, ...] = ()
    fmt: str = "auto"
    add_corpus: tuple[str, ...] = ()  # files added to the preset's (or given) corpus, each read by its own format
    weight: tuple[str, ...] = ()  # INPUT=K: a --corpus or --add-corpus input read K times (ingest's --weight)
    prompts: str | None = None
    chat: bool = False
    drafters: tuple[str, ...] = DRAFTERS
    percents: tuple[float, ...] = REST_PERCENTS
    top_t: tuple[int, ...] = ()  # empty: chosen to give sizes in REST's range
    keep: tuple[str, ...] = ("count",)  # savings, marginal: also a store per top-t at the count store's bytes
    suffix_rule: str = DEFAULT_SUFFIX_RULE  # the tree each row holds (crest.ingest.suffixes); stores: _<rule>
    suffix_judge: tuple[str, ...] = ()  # auto: the documents it chooses on (else a held-out slice)
    max_n: int = 4
    limit: int | None = None
    max_new_tokens: int = 128
    max_nodes: int = 64
    holdout: int = 200
    seed: int = 0
    timing: str = "largest"
    max_draft_tokens: int | None = None
    check: int = 1
    ablations: bool = False
    ablation_top_t: tuple[int, ...] = ()
    ablation_limit: int = 20
    rebuild: bool = False
    dense_positions: tuple[int, ...] = ()  # empty: chosen to give sizes in REST's range
    dense_corpus: tuple[str, ...] = ()  # empty: the run's corpus; else what the dense parts embed
    dense_top_t: int | None = None  # the crest store the hybrids merge with; None: the largest top-t
    dense_dims: int = 64
    dense_continuation: int = 16
    dense_precision: str = DEFAULT_DENSE_PRECISION  # the dense parts' vectors: half (halfvec) or single (vector)
    mt_bench: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> AcceptOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        if self.setting is not None and self.setting not in SETTINGS:
            raise ConfigError(f"unknown setting {self.setting!r}: use chat or code")
        if self.setting is None and not (self.corpus and self.prompts):
            raise ConfigError("give --setting chat|code, or --corpus and --prompts")
        check_judge(IngestOptions(suffix_rule=self.suffix_rule), judged=bool(self.suffix_judge))
        weigh_inputs([*self.corpus, *self.add_corpus], self.weight)  # a weight names a given input
        if self.add_corpus and self.corpus and self.fmt != "auto":
            raise ConfigError("--add-corpus files are read by their own format: with --corpus give --format auto")
        known = names("bench")
        bad = [d for d in self.drafters if d not in known]
        if bad or not self.drafters:
            raise ConfigError(f"unknown drafter(s) {', '.join(bad) or '(none given)'}: use {', '.join(known)}")
        if not self.percents or any(not 0 < p <= 100 for p in self.percents):
            raise ConfigError("--sizes are percentages of the corpus documents in (0, 100]")
        if any(t < 1 for t in (*self.top_t, *self.ablation_top_t)):
            raise ConfigError("--top-t values must be positive")
        if any(p < 1 for p in self.dense_positions) or not 2 <= self.dense_dims <= 4096:
            raise ConfigError("--dense-positions values must be positive and --dense-dims between 2 and 4096")
        if not 2 <= self.dense_continuation <= 256:
            raise ConfigError("--dense-continuation must be between 2 and 256")
        if self.dense_precision not in PRECISIONS:
            raise ConfigError(f"--dense-precision must be one of {', '.join(PRECISIONS)}, not {self.dense_precision!r}")
        if any(k not in KEEP_RULES for k in self.keep):
            raise ConfigError(f"unknown --keep {','.join(self.keep)!r}: use count, savings or marginal")
        if self.timing not in TIMING:
            raise ConfigError(f"--timing must be one of {', '.join(TIMING)}")
        if min(self.max_new_tokens, self.max_nodes, self.max_n) < 1 or self.holdout < 0 or self.check < 0:
            raise ConfigError("--max-new-tokens, --max-nodes and --max-n must be positive")
        if self.dense_top_t is not None and self.top_t and self.dense_top_t not in self.top_t:
            raise ConfigError(f"--dense-top-t {self.dense_top_t} is not one of --top-t {list(self.top_t)}")
        return self
