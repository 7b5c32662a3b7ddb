"""A new export is written beside the old one, checked, then swapped in.

The new files go into a temporary sibling of the destination ``d`` (same filesystem),
the user's own files of ``d`` are hard-linked into it, and the two directories are
exchanged with one atomic ``renameat2(RENAME_EXCHANGE)`` (elsewhere: two renames,
between which both complete exports exist as siblings). A crash at any step leaves
``d`` complete; at worst a ``.<name>.saving-*`` sibling remains.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

_AT_FDCWD: Final = -100
_RENAME_EXCHANGE: Final = 2


def destination(directory: str | os.PathLike[str]) -> Path:
    """The directory the export replaces (a symlink's target: the link stays)."""
    return Path(os.path.realpath(os.fspath(directory)))


def prepare(root: Path, needed_bytes: int) -> Path:
    """Make the temporary sibling of ``root``; first the OSError a later write would raise
    (not a directory, permission, no space)."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, "the export destination is not a directory", str(root)
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.exists() and not os.access(root, os.R_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "cannot read the existing directory", str(root))
    free = shutil.disk_usage(root.parent).free
    if free < needed_bytes:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: the export needs {needed_bytes} bytes beside the old "
            f"one, {free} are free",
            str(root.parent),
        )
    return Path(tempfile.mkdtemp(prefix=f".{root.name}.saving-", dir=root.parent))


def discard(work: Path) -> None:
    """Remove a temporary directory (an unfinished export, or the old one after a swap)."""
    shutil.rmtree(work, ignore_errors=True)


def _link_tree(source: Path, target: Path) -> None:
    """``target`` as a copy of ``source`` whose files are hard links where possible."""
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        target.mkdir()
        for child in source.iterdir():
            _link_tree(child, target / child.name)
    else:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where it is unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return False
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    result = function(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def swap_in(work: Path, root: Path, *, replaces: Callable[[str], bool]) -> None:
    """Make the finished export in ``work`` the directory ``root``; the old one goes. The
    entries of ``root`` neither written anew nor named by ``replaces`` are linked in first."""
    if not root.exists():
        os.rename(work, root)
        return
    for entry in root.iterdir():
        if not (work / entry.name).exists() and not replaces(entry.name):
            _link_tree(entry, work / entry.name)
    if _exchange(work, root):
        discard(work)  # ``work`` now holds the old export
        return
    logger.info("no atomic directory exchange here: renaming %s aside, then the new one in", root)
    aside = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
    aside.rmdir()
    os.rename(root, aside)
    try:
        os.rename(work, root)
    except OSError:
        os.rename(aside, root)
        raise
    discard(aside)
