"""The one base class of errors a user can fix: entry points print their message as one line, from one
rank, and exit with code 2 instead of showing a traceback per rank."""
from __future__ import annotations

import errno


class UserFacingError(Exception):
    """An error whose message alone says what is wrong (file, key, value) and what to do."""


class TrainingError(UserFacingError, RuntimeError):
    """Training cannot go on (a non-finite loss, a run folder in use); the message names the step or folder."""


class NoDenseEquivalent(UserFacingError, ValueError):
    """The model computes something no standard layout holds (nanotron_ext.models.dense); the message says which
    part and why, in one line."""


def one_line(text: str) -> str:
    """`text` as one line: its non-blank lines joined by "; " (a message with a second line of advice)."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


DISK_HINT = "free space there or make it writable (or set general.output_dir / checkpoints.dir)"
# the errors DISK_HINT is advice for: a full disk (a file size limit stands in for one in tests), no permission
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}


def os_error_line(error: OSError, hint: str = DISK_HINT, keys: str = "general.output_dir / checkpoints.dir") -> str:
    """An OSError that stopped a command as one line with the advice its errno calls for: `hint` (free space or
    make it writable) only for a full disk or a missing permission; a name too long for the file system says so
    (a long general.run once got "free space" advice), and an error without an errno (a library's, e.g. a
    damaged file's) gets none."""
    code = getattr(error, "errno", None)
    if code in _DISK_ERRNOS:
        return f"{error}; {hint}"
    if code == errno.ENAMETOOLONG:
        return (f"{error}; a name in that path is longer than the file system allows (255 bytes on most): shorten "
                f"it ({keys})")
    if code is None:
        return str(error)
    return f"{error}; check that path ({keys})"
