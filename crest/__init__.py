"""crest: compact, database-backed drafting stores for retrieval-based speculative decoding.

The library builds stores (`crest.ingest`), verifies draft trees against a Hugging Face causal LM
(`crest.verify`) and offers several drafters (`crest.drafters`); the light SDK lives in `crest_client`.
"""

from crest_client import Draft

__version__ = "0.1.0"

__all__ = ["Draft", "__version__"]
