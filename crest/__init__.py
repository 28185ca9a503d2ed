"""crest: compact, database-backed drafting stores for retrieval-based speculative decoding.

The public API, grouped as the code is: building a store (`crest.ingest`), the database (`crest.db`), drafters
(`crest.drafters`), decoding (`crest.decoding`); benchmarks (`crest.bench`) and the command line (`crest.cli`)
sit on top. Names are imported on first use, so `import crest` stays light (no torch until decoding is used).
`crest.ingest` is the subpackage (Python binds a subpackage's name on its parent once it is imported); the
function that builds a store is `crest.ingest.ingest`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from crest_client import Draft

if TYPE_CHECKING:
    from crest.config import IngestOptions
    from crest.decoding import GenerationResult, SpeculativeGenerator, load_model
    from crest.drafters import Drafter, make_drafter, open_drafter
    from crest.ingest import IngestSummary, load_tokenizer

__version__ = "0.1.0"

_LAZY = {
    "IngestOptions": "crest.config",
    "IngestSummary": "crest.ingest",
    "load_tokenizer": "crest.ingest",
    "Drafter": "crest.drafters",
    "make_drafter": "crest.drafters",
    "open_drafter": "crest.drafters",
    "GenerationResult": "crest.decoding",
    "SpeculativeGenerator": "crest.decoding",
    "load_model": "crest.decoding",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its subpackage on first use."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'crest' has no attribute {name!r}")


__all__ = [
    "Draft",
    "Drafter",
    "GenerationResult",
    "IngestOptions",
    "IngestSummary",
    "SpeculativeGenerator",
    "__version__",
    "load_model",
    "load_tokenizer",
    "make_drafter",
    "open_drafter",
]
