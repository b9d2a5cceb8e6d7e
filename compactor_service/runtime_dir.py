"""Where the compactor's socket and the shared pool files live, and the checks that keep
those directories private.

Defaults (computed once, at import, from this process's environment and uid; the
scheduler and the compactor compute the same values when they run as the same user):

    runtime directory   $XDG_RUNTIME_DIR/sglang-evict   when XDG_RUNTIME_DIR is set
                        /run/sglang-evict               when /run is writable (root, or a
                                                        service manager created it for us)
                        /tmp/sglang-evict-<uid>         otherwise
    socket              <runtime directory>/compactor.sock
    pool directory      /dev/shm/sglang-evict-<uid>     CPU pools must live in memory:
                                                        /dev/shm is a tmpfs on every Linux,
                                                        while /run and /tmp can be disk

A directory we use must be ours and private: owned by this process's effective uid,
not a symlink, and writable by nobody else (``mode & 0o022 == 0``). A missing one is
created with mode 0700. Anything else is refused (``InsecureDirectory``), since whoever
can write a socket's directory can replace the socket, and whoever can write the pool
directory can plant files for the compactor to map.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

APP_DIR_NAME = "sglang-evict"
SOCKET_NAME = "compactor.sock"


class InsecureDirectory(ValueError):
    """A directory that others could write, or that is not ours."""


def default_runtime_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The per-user runtime directory (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    uid = os.geteuid() if uid is None else uid
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / APP_DIR_NAME
    run = Path("/run") / APP_DIR_NAME
    if _owned_by(run, uid) or (not run.exists() and os.access("/run", os.W_OK)):
        return run
    return Path("/tmp") / f"{APP_DIR_NAME}-{uid}"


def default_pool_dir(uid: int | None = None) -> Path:
    uid = os.geteuid() if uid is None else uid
    return Path("/dev/shm") / f"{APP_DIR_NAME}-{uid}"


def _owned_by(path: Path, uid: int) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid


def ensure_private_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create ``path`` (mode 0700, parents as needed) if missing; then refuse it unless
    it is a real directory owned by us that nobody else can write. ``flag`` names the
    option that chose the directory, for the error message."""
    path = Path(path)
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise InsecureDirectory(
            f"{flag}: cannot create the directory {path} ({error.strerror}); choose a "
            f"directory you can write"
        ) from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InsecureDirectory(
            f"{flag}: {path} is a symlink or not a directory; give a real directory"
        )
    if info.st_uid != os.geteuid():
        raise InsecureDirectory(
            f"{flag}: directory {path} is owned by uid {info.st_uid}, not by this process "
            f"(uid {os.geteuid()}); use a directory of your own (or remove it so it is "
            f"created 0700)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise InsecureDirectory(
            f"{flag}: directory {path} has mode {mode:04o}, writable by others; "
            f"run `chmod 700 {path}` or use another directory"
        )
    return path


DEFAULT_RUNTIME_DIR = default_runtime_dir()
DEFAULT_SOCKET = str(DEFAULT_RUNTIME_DIR / SOCKET_NAME)
DEFAULT_POOL_DIR = str(default_pool_dir())
