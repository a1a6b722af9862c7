"""Small file helpers every part of the package shares: atomic text and binary writes, folder swaps, file
checksums and folder locks."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import IO, Optional

from nanotron_ext.errors import UserFacingError

LOCK_NAME = ".lock"


class FolderInUseError(UserFacingError):
    """Another live process holds the folder's lock; the message names it."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` so that a crash leaves either the old file or the new one, never a torn one
    (write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one, never a torn one
    (a unique temp file in the same folder, fsync, then os.replace; concurrent writers do not collide)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise named(e, path) from e
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result should look like any written file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):  # a write error names no file ("[Errno 28] No space left on device")
            raise named(e, path) from e
        raise


def replace_folder(new: Path, target: Path) -> None:
    """Put the folder `new` at `target` (a sibling), replacing what is there, so that a crash leaves either the old
    folder or the new one at `target`: one atomic exchange (Linux renameat2 RENAME_EXCHANGE), then the old one,
    now at `new`, is deleted. Elsewhere: two renames, the old folder kept beside `target` until the second is done."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.rename(new, target)
        return
    if not _exchange(new, target):
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.rename(new, target)
        new = old
    shutil.rmtree(new)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot (the caller falls back)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def named(error: OSError, path: Path) -> OSError:
    """`error` naming `path` (the file being written) when it names no file of its own."""
    if error.filename is not None:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


def lock_folder(folder: Path, what: str, instead: str) -> IO[str]:
    """Take an exclusive `flock` on `<folder>/.lock` (folder created if missing) and return the open file: the
    lock lasts until it is closed or the process ends, however it ends, so it is never stale. The file names its
    holder for the error a second taker gets: FolderInUseError naming `what` (e.g. "run folder") and, as the
    way out, `instead` (e.g. "another general.run")."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise FolderInUseError(f"{what} {folder} is in use by a running job ({holder}; lock {path}): wait for it to "
                               f"end or stop it, or use {instead}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text(path: Path, key: str) -> Optional[str]:
    """The value of a tEXt chunk `key` before the image data of a PNG, None when there is none (or no PNG)."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != _PNG_SIGNATURE:
                return None
            for _ in range(64):
                head = f.read(8)
                if len(head) < 8:
                    return None
                size, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND"):
                    return None
                if kind == b"tEXt" and size <= 4096:
                    name, _, value = f.read(size).partition(b"\0")
                    if name == key.encode("latin-1"):
                        return value.decode("latin-1")
                    f.seek(4, os.SEEK_CUR)
                else:
                    f.seek(size + 4, os.SEEK_CUR)
    except OSError:
        return None
    return None


def first_line(path: Path) -> str:
    """The first line of a file (its first 512 bytes), stripped; "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(512).split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    except OSError:
        return ""
