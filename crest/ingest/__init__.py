"""Building a store (`crest ingest`): corpus, token ids, n-gram counts, top-t selection, trees, a published version."""

from crest.decoding.tokenizer import Tokenizer, load_tokenizer
from crest.ingest.corpus import CorpusReport, iter_documents, read_jsonl
from crest.ingest.loader import Reporter, SilentReporter
from crest.ingest.ngrams import count_ngrams, select_top
from crest.ingest.pipeline import IngestSummary, ingest
from crest.ingest.tokenizer import tokenize_corpus
from crest.ingest.trees import TreeBatch, build_trees

__all__ = [
    "CorpusReport",
    "IngestSummary",
    "Reporter",
    "SilentReporter",
    "Tokenizer",
    "TreeBatch",
    "build_trees",
    "count_ngrams",
    "ingest",
    "iter_documents",
    "load_tokenizer",
    "read_jsonl",
    "select_top",
    "tokenize_corpus",
]
