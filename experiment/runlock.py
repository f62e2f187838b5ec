"""One run per checkpoint directory: a kernel lock on a file inside it.

Two runs on one checkpoint directory (a second terminal, a re-launched job) would read
checkpoints the other is replacing and delete each other's newest files. The lock is
flock(2) on DIR/.lock: the kernel releases it when the process ends, however it ends
(kill -9 included), so a crashed run never blocks the next one. The file is never
deleted (deleting it would let a third run lock a new file while the second holds the
old); it holds the holder's pid@host, for the message a refused run prints.

No TensorFlow here: a test can hold the lock from a small process.
"""

import errno
import fcntl
import os
import socket

from experiment import faults

LOCK_FILE = ".lock"


class LockError(OSError):
    """The directory is in use by another run, or cannot be locked; the message says
    which and what to do."""


class DirectoryLock:
    """An exclusive lock on `directory` (which must exist), held from `acquire` (or
    entering the `with` block) to `release` (or its end) or the process's end."""

    def __init__(self, directory):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *unused):
        self.release()

    def acquire(self):
        """Takes the lock at once or refuses: never waits.

        Raises:
          LockError: another process holds it (the message names it), the file system
            has no locks (ENOLCK), or the lock file cannot be created.
        """
        try:
            faults.check(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise self._error(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockError(
                    f"--checkpoint-dir {self.directory} is in use by another run "
                    f"({holder or 'its pid@host unknown'}, per {self.path}); wait for it to "
                    f"end, or use another --checkpoint-dir") from None
            raise self._error(e) from None
        self._fd = fd
        _write_holder(fd)

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None

    def _error(self, error):
        if error.errno == errno.ENOLCK:
            return LockError(f"--checkpoint-dir {self.directory}: cannot lock {self.path} "
                             f"({error.strerror}): this file system has no locks; use a "
                             f"directory on a local disk")
        return LockError(f"--checkpoint-dir {self.directory}: cannot create its lock file "
                         f"{self.path} ({error.strerror or error})")


def holder_text():
    """pid@host of this process, as the lock file records it."""
    return f"{os.getpid()}@{socket.gethostname()}"


def _read_holder(fd):
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _write_holder(fd):
    """Records pid@host for a refused run's message; the lock holds without it (a full
    disk may refuse these bytes)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder_text() + "\n").encode(), 0)
    except OSError:
        pass
