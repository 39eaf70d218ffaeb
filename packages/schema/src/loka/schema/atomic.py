"""Atomic file writes: a temporary file beside the destination, then a rename.

The temporary file gets the mode an ordinary new file gets under the user's umask (mkstemp
alone would leave it 0600, unreadable to the group a shared results folder is meant for).
Its name carries the host and process that wrote it, so that the next write to the same
destination can remove what a killed writer left behind without touching a live one's.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# A temporary file of the old naming (no host or pid) counts as abandoned after this long.
_UNKNOWN_OWNER_AGE_S = 3600.0


def umask() -> int:
    """The process's umask, read without changing it where the platform allows (setting
    and restoring it would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"


def _prefix(path: Path) -> str:
    return f".{path.name}."


def _owner_alive(host: str, pid: int) -> bool:
    if host != _host():
        return True  # another machine's writer (a shared file system): not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def clean_stale(path: Path) -> list[Path]:
    """Remove temporary files that an earlier, killed write to `path` left beside it.

    Only files named the way `atomic_write` names them are candidates; one is removed when
    the process that made it (same host) is gone, or, for the older naming without an owner,
    when it is over an hour old. Returns the removed paths; failures to remove are ignored.
    """
    removed = []
    owned = re.compile(re.escape(_prefix(path)) + r"([A-Za-z0-9_-]+)\.(\d+)\.[^./]+\.tmp")
    legacy = re.compile(re.escape(_prefix(path)) + r"[^./]+\.tmp")
    try:
        candidates = list(path.parent.iterdir())
    except OSError:
        return removed
    now = time.time()
    for tmp in candidates:
        match = owned.fullmatch(tmp.name)
        try:
            if match:
                stale = not _owner_alive(match.group(1), int(match.group(2)))
            elif legacy.fullmatch(tmp.name):
                stale = now - tmp.lstat().st_mtime > _UNKNOWN_OWNER_AGE_S
            else:
                continue
            if stale and tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call `write(temporary_path)` and rename the result over `path`.

    A reader sees either the old file or the complete new one; on any failure the temporary
    file is removed and the error propagates. The file's mode is 0666 less the umask.
    """
    path = Path(path)
    clean_stale(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{_prefix(path)}{_host()}.{os.getpid()}.", suffix=".tmp", dir=path.parent
    )
    try:
        os.fchmod(fd, 0o666 & ~umask())
        os.close(fd)
        fd = -1
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
