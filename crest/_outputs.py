"""Result files a command replaces whole: the real path behind a link, and only ever a regular file.

A command that writes a result file (`crest export`, `crest answer`) writes a temporary file beside it and renames
it over the target, so a reader never sees half a file. A rename replaces whatever holds the name: a symbolic link
would become a file and leave its target as it was, and a device, FIFO or socket (`/dev/full`, `/dev/stdout`) would
be swapped for a regular file. `output_file` follows links and refuses whatever is not a regular file.
"""

from __future__ import annotations

from pathlib import Path

from crest.errors import ConfigError


def output_file(path: str | Path, *, option: str) -> Path:
    """Return the file `path` names, links followed; raise ConfigError unless it is a regular file or missing."""
    given = Path(path).expanduser()
    if not given.name:
        raise ConfigError(f"{option} {str(path)!r} is a directory: give a file name")
    real = given.resolve()
    if real.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a directory: give a file name")
    if real.exists() and not real.is_file():
        raise ConfigError(f"{option} {str(path)!r} is not a regular file (a device, FIFO or socket): give a file name")
    return real
