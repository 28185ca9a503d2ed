"""Result files a command replaces whole: the real path behind a link, and only ever a regular file.

A command that writes a result file (`crest export`, `crest answer`) writes a file beside it and renames it over
the target, so a reader never sees half a file. A rename replaces whatever holds the name: a symbolic link would
become a file and leave its target as it was, and a device, FIFO or socket (`/dev/full`, `/dev/stdout`) would be
swapped for a regular file. `output_file` follows links and refuses whatever is not a regular file; `replacing`
is the write and the rename, in the real path's directory. A file written through a temporary one may keep its
0600; `created_mode` gives written files the mode a file created the usual way gets (0666 less the umask).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from crest.errors import ConfigError


def output_file(path: str | Path, *, option: str) -> Path:
    """Return the file `path` names, links followed; raise ConfigError unless it is a regular file or missing."""
    given = Path(path).expanduser()
    if not given.name:
        raise ConfigError(f"{option} {str(path)!r} is a directory: give a file name")
    try:
        real = given.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop: RuntimeError up to Python 3.12, OSError (ELOOP) after
        raise ConfigError(f"{option} {str(path)!r}: cannot follow its links ({exc})") from None
    if real.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a directory: give a file name")
    if real.exists() and not real.is_file():
        raise ConfigError(f"{option} {str(path)!r} is not a regular file (a device, FIFO or socket): give a file name")
    return real


@contextmanager
def replacing(target: Path, *, partial: Path | None = None) -> Iterator[IO[bytes]]:
    """Yield a file beside `target` (a path from `output_file`) that is renamed over it when the block ends.

    The file is opened first, so a directory that cannot be written is found before any work. Without `partial`
    it is a temporary file, removed if the block fails; `partial` names it instead and keeps what was written.
    """
    temp = partial or target.with_name(f".{target.name}.{os.getpid()}.tmp")  # the pid: two runs never share it
    try:
        sink = open(temp, "wb" if partial else "xb")  # noqa: SIM115  (closed below, before the rename)
    except OSError as exc:
        raise ConfigError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    try:
        with sink:
            yield sink
        os.replace(temp, target)
    except BaseException:
        if partial is None:
            temp.unlink(missing_ok=True)
        raise


def created_mode(paths: Iterable[Path]) -> None:
    """Give each file the mode a newly created file gets: 0666 less the process's umask."""
    mask = os.umask(0o022)  # the only way to read it: set it, and put it back at once
    os.umask(mask)
    for path in paths:
        path.chmod(0o666 & ~mask)
