"""Paths inside a directory ttftc does not trust: a name taken from the directory's own data becomes a path only
when it stays inside that directory.

A name is a relative path of plain parts (letters, digits, `_`, `-`, `.`; no empty part, no `.` or `..`, no
backslash). The directory holding the file, symlinks resolved, must be the root or lie inside it (also resolved),
and the file itself is never followed as a symlink: `read_regular` opens it with O_NOFOLLOW and reads only a regular
file (a FIFO would block the reader forever) no larger than the caller's limit for that kind of file, checked before
reading; `regular_file` checks the same with lstat, and unlinking or renaming
over a symlink replaces the link, not its target. So neither a crafted name (`../x`, `/etc/passwd`) nor a symlink
planted in the directory makes ttftc read, write or delete a file elsewhere.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Optional

_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")


class UnsafePathError(ValueError):
    """A file name from untrusted data does not stay inside its directory, or names something not a plain file."""


def confined_path(root: Path, name: str) -> Path:
    """root/name, once `name` is a plain relative name whose directory, symlinks resolved, is inside `root`."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"file name {name!r} is not a non-empty string")
    parts = name.split("/")
    if "\\" in name or not all(_PART.match(part) and part not in (".", "..") for part in parts):
        raise UnsafePathError(f"file name {name!r} is not a plain relative path inside {root}")
    real_root = Path(root).resolve()
    parent = real_root.joinpath(*parts[:-1]).resolve()
    if parent != real_root and real_root not in parent.parents:
        raise UnsafePathError(f"{name!r} leads outside {root} (its directory is {parent})")
    return parent / parts[-1]


def regular_file(path: Path) -> Path:
    """`path` when it is a regular file and not a symlink; FileNotFoundError when there is nothing there."""
    mode = os.lstat(path).st_mode  # raises FileNotFoundError
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{path} is not a regular file ({'a symlink' if stat.S_ISLNK(mode) else 'special'})")
    return path


def read_regular(path: Path, *, limit: int) -> bytes:
    """The bytes of the regular file at `path`, refusing a symlink or a special file at the last component, and a
    file of more than `limit` bytes.

    The limit is required: every kind of file ttftc reads has its own, and it is checked against fstat before a
    byte is read, so a huge (or sparse) file costs nothing. The descriptor is closed on every path, a refusal
    included: one leaked per refused request would run a server out of descriptors.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TypeError(f"read_regular needs a byte limit (a non-negative int), got {limit!r}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UnsafePathError(f"{path} cannot be opened as a regular file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "special"
            raise UnsafePathError(f"{path} is not a regular file ({kind})")
        if info.st_size > limit:
            raise UnsafePathError(f"{path} is larger than {limit} bytes ({info.st_size})")
        chunks, remaining = [], limit + 1  # one byte more than allowed: a file that grew since fstat is refused
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:  # an I/O error, or a directory that fstat could not see as one
        raise UnsafePathError(f"{path} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise UnsafePathError(f"{path} is larger than {limit} bytes")
    return data
