"""Learning from what stores serve: the learned log, the live tier built from it, and forgetting it."""

from crest.learning.forget import ForgetResult, forget
from crest.learning.journal import Window, append_learned, read_window
from crest.learning.live import RefreshResult, refresh_live
from crest.learning.refresher import Refresher
from crest.learning.requests import record_outcome, request_stats, served_tokens, store_max_n, tally_parts
from crest.learning.transcripts import Transcripts, learn_files, read_transcripts

__all__ = [
    "ForgetResult",
    "RefreshResult",
    "Transcripts",
    "Window",
    "append_learned",
    "forget",
    "learn_files",
    "read_transcripts",
    "read_window",
    "record_outcome",
    "refresh_live",
    "Refresher",
    "request_stats",
    "served_tokens",
    "store_max_n",
    "tally_parts",
]
