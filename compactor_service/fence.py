"""The pass fence: a late kernel can never write a pool whose client gave up on it.

A client that stops waiting for a ``Compact`` call (its deadline passed, the connection
broke) completes the pass in-process and hands the pages it freed out again. A
compactor that was only slow (descheduled, stopped, busy parsing another client's
message) could then still start its copy of the same plans: the copy reads source
slots that new tokens now own and writes their bytes over survivors. The deadline check
right before the kernel narrows that window; the fence closes it.

The fence is one small file per pool, created by the scheduler in the pool directory
(``sglang-evict-fence-<pid>-<hex>``, 16 bytes, mode 0600), registered with the pool,
and an exclusive ``flock`` on it. It holds two little-endian uint64: ``revoked``, the
highest call sequence number the client gave up on, and ``started``, the highest one
whose kernel the compactor started. Every ``Compact`` call carries its sequence number
(``call_seq``, increasing per registration)::

    compactor                                   client, after giving up on call n
    lock the fence (waiting at most until      lock the fence (waiting as long as it
      the caller's deadline)                     takes: see below)
    call_seq <= revoked? -> refuse, nothing    revoked = max(revoked, n)
      moved (PassRevoked)                      moved = started >= n
    started = call_seq                         unlock
    kernel (+ device synchronisation)          moved? complete the pass in-process;
    unlock                                        else the call moved nothing
    reply

Both sides hold the lock for a few reads and writes, or for one kernel. So once the
client's revocation returns, any copy of call n either finished before it (the
in-process completion repeats it: moves are idempotent and their sources are unchanged
until the client frees them) or will never start. A compactor that dies releases the
lock with its descriptors (the kernel drops ``flock`` locks of a dead process), so
"answered or known dead" is exactly "the lock could be taken". A compactor stopped
*inside* its copy holds the lock: the client then waits, logging every
``WAIT_LOG_INTERVAL_S``, since no choice is safe while another process is half-way
through writing its memory; stopping or killing that compactor ends the wait.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from compactor_service.compactor import PassAbandoned

logger = logging.getLogger("sglang_evict.compactor.fence")

FENCE_FILE_PREFIX = "sglang-evict-fence-"
FENCE_FILE_NAME = re.compile(re.escape(FENCE_FILE_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{12}")
FENCE_BYTES = 16
_FIELDS = struct.Struct("<QQ")  # revoked, started
# How often a waiting side retries the lock; how often a client waiting on a compactor
# that holds its fence says so.
POLL_INTERVAL_S = 0.002
WAIT_LOG_INTERVAL_S = 5.0


class PassRevoked(PassAbandoned):
    """The client gave up on this call before its kernel could start: nothing moved."""


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _read(fd: int) -> tuple[int, int]:
    """``(revoked, started)``; a file shorter than the fence (its client truncated
    it) reads as all revoked: no kernel may start."""
    data = os.pread(fd, FENCE_BYTES, 0)
    return _FIELDS.unpack(data) if len(data) == FENCE_BYTES else (2**64 - 1, 0)


class CompactorFence:
    """The compactor's side: an open descriptor of a registered pool's fence file (the
    pool directory's checks passed), held for the pool's life."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @contextmanager
    def hold(self, call_seq: int, still_wanted: Callable[[], bool] | None) -> Iterator[None]:
        """Hold the fence around a kernel: refuse (``PassRevoked``) a call the client
        gave up on, or (``PassRevoked`` too) one whose caller stopped waiting while the
        client held the lock. The kernel runs inside the ``with`` block."""
        while not _try_lock(self.fd):
            if still_wanted is not None and not still_wanted():
                raise PassRevoked(
                    "the caller stopped waiting while its fence was held: nothing moved"
                )
            time.sleep(POLL_INTERVAL_S)
        try:
            revoked, _ = _read(self.fd)
            if call_seq <= revoked:
                raise PassRevoked(
                    f"call {call_seq} was given up by its client (revoked through "
                    f"{revoked}) before the kernel started: nothing moved"
                )
            os.pwrite(self.fd, _FIELDS.pack(revoked, call_seq), 0)
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


class ClientFence:
    """The scheduler's side: creates the fence file, numbers calls, revokes them."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / f"{FENCE_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.path, flags, 0o600)
        os.pwrite(self.fd, _FIELDS.pack(0, 0), 0)
        self._last_seq = 0
        self.waits = 0  # revocations that had to wait for a compactor holding the fence

    def next_seq(self) -> int:
        self._last_seq += 1
        return self._last_seq

    def revoke(self, call_seq: int, clock_s: Callable[[], float] = time.monotonic) -> bool:
        """Make sure call ``call_seq`` (and every earlier one) never starts its kernel
        and that none of them is still copying: take the lock (waiting for a compactor
        inside its copy, however long), record the revocation, release. Returns whether
        the kernel of call ``call_seq`` started (then it has finished: it may have
        moved slots); False: that call moved nothing and never will."""
        start = last_log = clock_s()
        waited = False
        while not _try_lock(self.fd):
            waited = True
            now = clock_s()
            if now - last_log >= WAIT_LOG_INTERVAL_S:
                last_log = now
                logger.error(
                    "the compactor holds this pool's fence (it is inside its copy of "
                    "call %d) and has not answered for %.0f s: waiting for it to finish or "
                    "exit before completing the pass in-process; a stopped compactor "
                    "blocks this scheduler until it is continued or killed",
                    call_seq,
                    now - start,
                )
            time.sleep(POLL_INTERVAL_S)
        try:
            revoked, started = _read(self.fd)
            os.pwrite(self.fd, _FIELDS.pack(max(revoked, call_seq), started), 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.waits += waited
        return started >= call_seq

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.path.unlink(missing_ok=True)
