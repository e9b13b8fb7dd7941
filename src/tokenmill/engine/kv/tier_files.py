"""The disk tier's folder, kept the way a database keeps its data directory.

* One process at a time: ``TierFolder.open`` takes an exclusive ``flock`` on
  ``kv_tier.lock`` for as long as the tier is open (the kernel drops it when the
  process dies, so a crash never leaves a stale lock) and writes its pid, host
  and start time there; a second process is refused with those named. Two
  processes on one folder would overwrite each other's slots.
* Nothing in the folder is trusted to be ours: every file is opened relative to
  the folder's descriptor with ``O_NOFOLLOW`` and checked (a regular file, owned
  by this user, one link), so a symbolic or hard link planted there is refused,
  never followed or written through. The folder itself must be ours and not
  writable by others (who could plant such links).
* Space is reserved up front (``posix_fallocate``), not left sparse: on a full
  filesystem a sparse file's first write into a hole kills a memory-mapping
  process (SIGBUS) or fails later; asking for more than the filesystem has free
  is refused at start, with both numbers.
* Whole-file rewrites (the header, a compacted index) go to a temporary file that
  replaces the old one by ``rename``, so a reader sees the old or the new, never
  half of either.
* Index lines carry their own checksum, salted with the tier's identity: a line
  torn by a crash, damaged on disk or written for another model reads as damaged
  and is skipped (``decode_line``), never as an entry.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import zlib
from dataclasses import dataclass

from ...files.unsupported import StartupRefused

LOCK_NAME, DATA_NAME, INDEX_NAME, META_NAME = "kv_tier.lock", "kv_tier.bin", "kv_tier.index", "kv_tier.json"
MAX_LINE = 1 << 20  # longer than any entry's line: what is longer is damage, skipped


class TierRefused(StartupRefused):
    """The tier's folder cannot be used as asked; the message says why and what to do."""


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


@dataclass
class TierFolder:
    """The open, locked folder: file descriptors of the folder and of its lock file."""

    path: str
    dir_fd: int
    lock_fd: int

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "TierFolder":
        """Create the folder if needed (mode 0700), check it is ours and lock it, or refuse."""
        path = os.fspath(path)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a link named by the operator is fine
        except OSError as exc:
            raise TierRefused(f"--kv-offload-dir {path}: {exc.strerror}") from None
        folder = cls(path, dir_fd, -1)
        try:
            st = os.fstat(dir_fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise TierRefused(f"--kv-offload-dir {path} must be owned by this user (uid {os.geteuid()}) and "
                                  f"writable by nobody else (it is uid {st.st_uid}, mode "
                                  f"{stat.S_IMODE(st.st_mode):o}): others could plant links there")
            folder.lock_fd = folder.open_file(LOCK_NAME, os.O_RDWR | os.O_CREAT)
            folder._lock()
        except BaseException:
            folder.close()
            raise
        return folder

    def _lock(self) -> None:
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TierRefused(f"--kv-offload-dir {self.path}: cannot lock {LOCK_NAME}: {exc.strerror}") from None
            raise TierRefused(f"--kv-offload-dir {self.path} is in use by another tokenmill process "
                              f"({self._holder()}); two servers on one tier would overwrite each other's "
                              "blocks: give each server its own folder") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            os.ftruncate(self.lock_fd, 0)
            write_all(self.lock_fd, json.dumps(me).encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only its holder goes unnamed

    def _holder(self) -> str:
        try:
            info = json.loads(os.pread(self.lock_fd, 4096, 0))
            return f"pid {int(info['pid'])} on host {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def open_file(self, name: str, flags: int) -> int:
        """``name`` in the folder, never through a link; refused unless a regular file of ours
        with one link (a hard link would let writes reach a file elsewhere)."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
        except OSError as exc:
            why = "a symbolic link (never followed)" if exc.errno == errno.ELOOP else exc.strerror
            raise TierRefused(f"--kv-offload-dir {self.path}: {name} is {why}; remove it or use another "
                              "folder") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise TierRefused(f"--kv-offload-dir {self.path}: {name} is not a regular file of this user with "
                              f"one link (uid {st.st_uid}, {st.st_nlink} links); remove it or use another folder")
        return fd

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def read(self, name: str) -> bytes | None:
        """A small file's contents (the header), or None if there is none."""
        if not self.exists(name):
            return None
        fd = self.open_file(name, os.O_RDONLY)
        try:
            return os.read(fd, MAX_LINE)
        finally:
            os.close(fd)

    def replace(self, name: str, chunks: list[bytes]) -> None:
        """Write ``name`` whole: a temporary file, synced, then renamed over it (OSError on failure)."""
        tmp = f".{name}.tmp"  # one writer: the folder is locked
        try:
            os.unlink(tmp, dir_fd=self.dir_fd)  # left by a crash; a link is removed, not followed
        except FileNotFoundError:
            pass
        fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, b"".join(chunks), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def free_bytes(self) -> int:
        st = os.statvfs(self.dir_fd)
        return st.f_bavail * st.f_frsize

    def check_room(self, asked: int, fd: int | None = None) -> None:
        """Refuse, with the numbers, if the filesystem cannot hold ``asked`` bytes more than
        ``fd`` (the data file) already has allocated."""
        have = os.fstat(fd).st_blocks * 512 if fd is not None else self._allocated(DATA_NAME)
        free = self.free_bytes()
        if asked - have > free:
            raise TierRefused(f"--kv-offload-bytes asks for {_mib(asked)} in {self.path}, but its filesystem has "
                              f"{_mib(free)} free (the tier's file holds {_mib(have)} already): free some space "
                              "or ask for less")

    def _allocated(self, name: str) -> int:
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0

    def reserve(self, fd: int, size: int) -> None:
        """Make the data file exactly ``size`` bytes, every one allocated, or refuse."""
        self.check_room(size, fd)
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # macOS: no fallocate; zeros written are allocated all the same
                _write_zeros(fd, os.fstat(fd).st_size, size)
        except OSError as exc:
            raise TierRefused(f"--kv-offload-bytes: cannot reserve {_mib(size)} in {self.path} "
                              f"({exc.strerror}; {_mib(self.free_bytes())} free)") from None

    def close(self) -> None:
        """Release the lock (closing its descriptor) and the folder; idempotent."""
        for fd in (self.lock_fd, self.dir_fd):
            if fd >= 0:
                os.close(fd)
        self.lock_fd = self.dir_fd = -1


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (a short write is retried where it stopped)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_zeros(fd: int, start: int, end: int) -> None:
    zeros = bytes(1 << 20)
    for offset in range(start, end, len(zeros)):
        write_all(fd, zeros[:min(len(zeros), end - offset)], offset)


def read_into(fd: int, buf: memoryview, offset: int) -> None:
    """``preadv`` until ``buf`` is full; a file shorter than that is an OSError (EIO)."""
    view = buf.cast("B")
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(errno.EIO, "the tier's file is shorter than its slots")
        view, offset = view[n:], offset + n


def encode_line(salt: bytes, record: dict) -> bytes:
    """One index line: the record's JSON after a CRC32 of the salt (the tier's identity) and the JSON."""
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body, zlib.crc32(salt)), body)


def decode_line(salt: bytes, line: bytes) -> dict | None:
    """The record of a line ``encode_line`` wrote with the same salt, else None (damaged)."""
    head, _, body = line.rstrip(b"\n").partition(b" ")
    try:
        if len(head) != 8 or int(head, 16) != zlib.crc32(body, zlib.crc32(salt)):
            return None
        record = json.loads(body)
    except ValueError:  # not hex, not JSON, not UTF-8
        return None
    return record if isinstance(record, dict) else None
