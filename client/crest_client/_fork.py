"""What the SDK renews in a child made by `os.fork()`: every registered object's `after_fork()`, run in the child.

A forked child holds one thread, the one that forked: the parent's background threads (a `Learner`'s writer, a
`Store`'s version loader) are gone, a lock one of them held at the fork stays held, and the queued work they would
have done belongs to the parent, which does it. `renew_in_child(obj)` registers an object (weakly) whose
`after_fork()` then runs in every child right after the fork, before anything else does: it leaves what is the
parent's (its connections, its queue) to the parent and makes fresh locks, and the object starts the threads it
needs again at its first use in the child (not in the handler: a thread started there may run before the child's
interpreter has settled). `at_child_exit(obj, method)` has a child made by `multiprocessing` (which ends with
`os._exit`, running no `atexit` handler) call `obj.method()` as it ends. A private module with public names.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

log = logging.getLogger(__name__)

_RENEWED: weakref.WeakSet[Any] = weakref.WeakSet()  # objects whose after_fork() runs in a forked child


def renew_in_child(obj: Any) -> None:
    """Have `obj.after_fork()` run in every child forked from now on (as long as `obj` lives)."""
    _RENEWED.add(obj)


def at_child_exit(obj: Any, method: str) -> None:
    """Have a `multiprocessing` child call `obj.<method>()` as it ends, if `obj` still lives (others run atexit)."""
    from multiprocessing import util

    ref = weakref.ref(obj)
    util.Finalize(obj, _call_method, args=(ref, method), exitpriority=10)


def _call_method(ref: weakref.ref[Any], method: str) -> None:
    obj = ref()
    if obj is not None:
        try:
            getattr(obj, method)()
        except Exception as exc:  # a child's exit goes on
            log.debug("at the child's exit, %s.%s() failed: %s", type(obj).__name__, method, exc)


def _after_fork_in_child() -> None:
    """Renew every registered object in the child (one that fails is logged; the others are still renewed)."""
    for obj in list(_RENEWED):
        try:
            obj.after_fork()
        except Exception as exc:
            log.warning("after fork: %s could not be renewed: %s", type(obj).__name__, exc)


os.register_at_fork(after_in_child=_after_fork_in_child)
