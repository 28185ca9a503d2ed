"""The crest drafter: trees from a crest store through the SDK (`crest_client.Store`).

A store or database error costs that step's draft only: it is logged once and the step is verified without a
draft, so generation goes on with the same output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import psycopg
from crest_client.draft import Draft

from crest.errors import CrestClientError

log = logging.getLogger(__name__)


_STORE_ERRORS = (CrestClientError, psycopg.Error, OSError)  # OSError covers socket errors and TimeoutError


class StoreDrafter:
    """Drafts from a crest store through the SDK; store and database errors give no draft for that step."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.failures = 0

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the store's tree for the context (at most `max_nodes` nodes), or None."""
        try:
            tree = self.store.draft(context_ids, max_nodes=max_nodes)
        except _STORE_ERRORS as exc:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(level, "store draft failed, no draft this step (logged once): %s", exc)
            return None
        if tree is None or len(tree) == 0 or max_nodes <= 0:
            return None
        return tree.truncate(max_nodes)
