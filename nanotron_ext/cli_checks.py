"""Checks every command line runs on its arguments before doing any work: each failure is a UserFacingError
naming the flag and the value (or file), which the entry points print as one line with exit code 2."""
from __future__ import annotations

import errno
import io
import json
import math
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

from nanotron_ext.errors import UserFacingError, one_line
from nanotron_ext.fileio import first_line, png_text, write_bytes_atomic, write_text_atomic

MAX_RESULT_BYTES = 64 * 2**20  # a result JSON is KBs to a few MB; a larger file is not one


class ArgumentError(UserFacingError, ValueError):
    """A command-line value that cannot work; the message names the flag."""


def at_least(flag: str, value: Optional[int], low: int) -> None:
    """An integer flag (None: not given, its default applies) must be >= `low`."""
    if value is not None and value < low:
        raise ArgumentError(f"{flag} {value}: must be >= {low}")


def finite(flag: str, value: float, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> None:
    """A float flag must be a finite number in [low, high] ((low, high] with `low_open`)."""
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ArgumentError(f"{flag} {value}: must be a finite number in {bounds}")


def utf8_text(flag: str, value: str) -> None:
    """A text flag must be UTF-8: bytes that are not reach Python as surrogates (os.fsdecode), which a tokenizer
    or print() fails on with a traceback."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = os.fsencode(value)
        at = len(value[:e.start].encode("utf-8", "surrogateescape"))
        raise ArgumentError(f"{flag} {ascii(raw)[1:]}: not valid UTF-8 text (byte 0x{raw[at]:02x} at position {at}); "
                            "give UTF-8 text") from None


def refuse(error: Exception | str) -> NoReturn:
    """The end of a command whose argument `error` refused: its one line on stderr, exit code 2 (no traceback)."""
    print(f"error: {one_line(str(error))}", file=sys.stderr, flush=True)
    raise SystemExit(2)



_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
            (stat.S_ISSOCK, "a socket"))
CHECKOUT = Path(__file__).resolve().parents[1]  # the checkout this package runs from (an editable install's)


def input_file(flag: str, path: str | Path, checkout: bool = False, folder: bool = False) -> Path:
    """A file the command reads (with `folder`, a folder): a regular file it can open, or a folder it can list (a
    folder where a file goes, a device, a pipe, a dangling or looping symbolic link, no read permission: refused).
    With `checkout`, a relative path that is not in the current folder is looked for in the checkout (a default
    naming one of its files, run from another folder). Returns the path found."""
    p = Path(path).expanduser()
    if checkout and not p.is_absolute() and not os.path.lexists(p):
        if not os.path.lexists(CHECKOUT / p):
            raise ArgumentError(f"{flag} {p} does not exist (looked in {Path.cwd()} and in the checkout {CHECKOUT})")
        p = CHECKOUT / p
    try:
        if p.is_symlink() and not p.exists():
            raise ArgumentError(f"{flag} {p} is a symbolic link to nothing (or a loop)")
        if not p.exists():
            raise ArgumentError(f"{flag} {p} does not exist")
        if folder:
            if not p.is_dir():
                raise ArgumentError(f"{flag} {p} is not a folder; a folder is expected")
            with os.scandir(p) as entries:  # (listed, and closed: an open iterator is a ResourceWarning)
                next(entries, None)
        elif p.is_dir():
            raise ArgumentError(f"{flag} {p} is a folder; a file is expected")
        elif not p.is_file():  # /dev/zero read until memory ran out, a FIFO blocked
            mode = p.stat().st_mode
            kind = next((name for test, name in _SPECIAL if test(mode)), "a special file")
            raise ArgumentError(f"{flag} {p} is {kind}, not a file; a file is expected")
        else:
            open(p, "rb").close()
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ArgumentError(f"{flag} {p} cannot be read ({e.strerror}); check its permissions") from None
        raise unchecked(flag, p, e) from None
    return p


# -- JSON files a command reads -------------------------------------------------------------------------------------
def json_kind(value: Any) -> str:
    """What a JSON value is, as a message says it: "a JSON list", "a JSON number", ..."""
    if isinstance(value, bool):
        return f"JSON {str(value).lower()}"
    if value is None:
        return "JSON null"
    kinds = {dict: "object", list: "list", str: "string", int: "number", float: "number"}
    return f"a JSON {next((k for t, k in kinds.items() if isinstance(value, t)), type(value).__name__)}"


@dataclass(frozen=True)
class JsonFile:
    """A JSON file a command reads (a data manifest, a checkpoint's meta.json, a saved result), whose every problem
    is one `error` (a UserFacingError) naming `label` (what the file is to the command: "--merge", "the data
    manifest"), the file and what is wrong with it, then `advice` (what to do). `read` checks the file and parses
    it; `need`, `number` and `table` check the shape of what was read, naming the part (`where`) and the key."""

    path: Path
    label: str
    error: type = ArgumentError
    advice: str = ""
    max_bytes: int = MAX_RESULT_BYTES

    def fail(self, problem: str) -> NoReturn:
        """Refuse the file: `problem` follows its name ("is not JSON ...", or "splits is missing" after a colon)."""
        whole = problem.split(" ", 1)[0] in ("is", "holds", "has", "does", "cannot")
        raise self.error(f"{self.label} {self.path}{' ' if whole else ': '}{problem}"
                         + (f"; {self.advice}" if self.advice else ""))

    def read(self) -> Any:
        """The parsed file: refused when it is missing, not a regular file (a FIFO blocked, /dev/zero filled the
        memory), larger than `max_bytes`, not UTF-8 (binary) or not JSON (garbage, cut short)."""
        text = self._text()
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            self.fail(f"is not JSON ({e.msg} at line {e.lineno} column {e.colno}: damaged or cut short)")
        except RecursionError:
            self.fail("is not JSON a program wrote (nested too deeply)")

    def read_lines(self) -> List[Dict[str, Any]]:
        """A JSON-lines file: one object per line (blank lines skipped), the file checked as `read` checks it."""
        rows: List[Dict[str, Any]] = []
        for number, line in ((n, ln) for n, ln in enumerate(self._text().splitlines(), 1) if ln.strip()):
            try:
                rows.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                self.fail(f"line {number} is not JSON (damaged or cut short)")
            if not isinstance(rows[-1], dict):
                self.fail(f"line {number} is {json_kind(rows[-1])}, not an object")
        return rows

    def _text(self) -> str:
        p = self.path
        try:
            if p.is_symlink() and not p.exists():
                self.fail("is a symbolic link to nothing (or a loop)")
            if not p.exists():
                self.fail("does not exist")
            if not p.is_file():
                self.fail("is not a file (a folder, a device or a pipe?)")
            size = p.stat().st_size
            if size > self.max_bytes:
                self.fail(f"has {size:,} bytes, more than such a file holds ({self.max_bytes:,} at most)")
            raw = p.read_bytes()
        except OSError as e:
            self.fail(f"cannot be read ({e.strerror or e})")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"is not UTF-8 text (byte {e.start} of {len(raw):,}: binary or damaged)")
        if not text.strip():
            self.fail("is empty")
        return text

    def read_object(self) -> Dict[str, Any]:
        """`read`, which must give a JSON object."""
        value = self.read()
        if not isinstance(value, dict):
            self.fail(f"holds {json_kind(value)}, not an object")
        return value

    def need(self, obj: Mapping[str, Any], key: str, kinds: Any, where: str = "", *, optional: bool = False) -> Any:
        """obj[key], which must be of `kinds` (a type or tuple of types; bool is never a number); a missing key is
        refused unless `optional` (then None, as for null). `where` names obj in the file (e.g. "runs[3]"), and
        the message names the key as where.key."""
        name = _dotted(where, key)
        if key not in obj or (optional and obj[key] is None):
            if optional:
                return None
            self.fail(f"{name} is missing")
        value = obj[key]
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        numeric = all(k in (int, float) for k in kinds)
        if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
            wanted = " or ".join(dict.fromkeys(_KIND_NAMES.get(k, k.__name__) for k in kinds))
            self.fail(f"{name} is {json_kind(value)}, not {wanted}")
        return value

    def number(self, obj: Mapping[str, Any], key: str, where: str = "", *, low: float = -math.inf,
               low_open: bool = False, optional: bool = False) -> Optional[float]:
        """obj[key] as a finite number >= `low` (> with `low_open`); NaN and infinities are refused."""
        value = self.need(obj, key, (int, float), where, optional=optional)
        if value is None:
            return None
        name = _dotted(where, key)
        if not math.isfinite(value):
            self.fail(f"{name} is {value}, not a finite number")
        if value < low or (low_open and value == low):
            self.fail(f"{name} is {value:g}; it must be {'>' if low_open else '>='} {low:g}")
        return float(value)

    def table(self, obj: Mapping[str, Any], key: str, kinds: Any, where: str = "") -> Dict[str, Any]:
        """obj[key], an object whose every value is of `kinds`."""
        table = self.need(obj, key, dict, where)
        for k in table:
            self.need(table, k, kinds, _dotted(where, key))
        return table


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true or false"}


# -- files a command writes -----------------------------------------------------------------------------------------
MARKER_KEY = "written_by"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Writer:
    """The one rule for every file a command writes (plan --json, eval --json, a reproduction script's or the WAN
    meter's --out, the analyse modules, slow_link, param_counts):

    - the exact paths are checked when the arguments are parsed, before any work (`output_file`, `output_files`,
      `output_stem`, `output_folder`): refused, as one line naming the flag, when a path is a folder where a file
      goes, a device, a pipe or another non-regular file, a dangling symlink, when a part of its parent path is a
      file, or when the nearest existing folder above it is not writable (missing folders below it are created);
    - an existing file is replaced only when this writer wrote it, recognised by its marker: a JSON result is an
      object with "written_by": `marker`; a markdown file's first line is `<!-- written by MARKER -->`; a PNG has
      the text chunk written_by=MARKER (matplotlib's savefig metadata). Files written before markers existed
      (committed results under reproduce/ and benchmarks/results/) are recognised by their shape: a JSON object
      with every one of `legacy_keys`, or one `legacy_shape` accepts; the files written with a recognised result
      (the .md and .png of its stem, a figure beside it) may be replaced too. Anything else (a run's metrics.jsonl,
      summary.json, config.yaml, a user's file) is never replaced;
    - files are written atomically (fileio.write_text_atomic / write_bytes_atomic) through `write_json`,
      `write_markdown` and `save_png`, which add the marker.

    `marker` names the code that writes: a command (e.g. "python -m nanotron_ext.plan"), or nanotron_ext.bench.report
    for every result published through it (reproduction scripts, benchmarks, the meter); `what` names it in
    messages."""

    marker: str
    what: str = ""
    legacy_keys: Tuple[str, ...] = ()
    legacy_shape: Optional[Callable[[Any], bool]] = None

    @property
    def name(self) -> str:
        return self.what or self.marker

    @property
    def markdown_marker(self) -> str:
        return f"<!-- written by {self.marker} -->"

    def wrote(self, path: Path) -> bool:
        """Whether the existing file `path` carries this writer's marker (or is one of its legacy JSON results),
        whatever its name: a PNG by its text chunk, markdown by its first line, anything else as JSON."""
        try:
            if not path.is_file():  # never opened: a FIFO blocks
                return False
            with open(path, "rb") as f:
                head = f.read(512)
        except OSError:
            return False
        if head.startswith(PNG_SIGNATURE):
            return png_text(path, MARKER_KEY) == self.marker
        if head.split(b"\n", 1)[0].decode("utf-8", "replace").strip() == self.markdown_marker:
            return True
        obj = _read_json(path)
        return isinstance(obj, dict) and (obj.get(MARKER_KEY) == self.marker or self._legacy(obj))

    def _legacy(self, obj: Dict[str, Any]) -> bool:
        if MARKER_KEY in obj:  # another writer's result
            return False
        if self.legacy_keys and all(k in obj for k in self.legacy_keys):
            return True
        return self.legacy_shape is not None and bool(self.legacy_shape(obj))

    def json_text(self, obj: Mapping[str, Any], indent: int = 2, default: Optional[Callable[[Any], Any]] = None) -> str:
        """`obj` as JSON with the marker as its first key."""
        marked = {MARKER_KEY: self.marker, **{k: v for k, v in obj.items() if k != MARKER_KEY}}
        return json.dumps(marked, indent=indent, default=default) + "\n"

    def write_json(self, path: str | Path, obj: Mapping[str, Any], indent: int = 2,
                   default: Optional[Callable[[Any], Any]] = None) -> Path:
        """`obj` with the marker as its first key, written atomically."""
        write_text_atomic(Path(path), self.json_text(obj, indent, default))
        return Path(path)

    def write_markdown(self, path: str | Path, text: str) -> Path:
        """`text` below the marker line (an HTML comment: not rendered), written atomically."""
        write_text_atomic(Path(path), f"{self.markdown_marker}\n{text}")
        return Path(path)

    def save_png(self, fig: Any, path: str | Path, dpi: int = 100) -> Path:
        """A matplotlib figure as PNG with the marker's text chunk, written atomically."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={MARKER_KEY: self.marker})
        write_bytes_atomic(Path(path), buf.getvalue())
        return Path(path)

    def _foreign(self, flag: str, p: Path) -> ArgumentError:
        suffix = p.suffix.lower()
        if suffix == ".md":
            how = f"a markdown file starting {self.markdown_marker}, or beside its result"
        elif suffix == ".png":
            how = f"a PNG marked {MARKER_KEY}={self.marker}, or beside its result"
        elif suffix == ".csv":
            how = f"a CSV beside a markdown file starting {self.markdown_marker}"
        elif self.legacy_keys:
            how = f"a JSON object with {', '.join(self.legacy_keys)}"
        else:
            how = f'a JSON object with "{MARKER_KEY}": "{self.marker}"'
        return ArgumentError(f"{flag} {p} exists and is not an earlier result of {self.name} ({how}); nothing was "
                             "written: choose another file")


def output_file(flag: str, path: str | Path, writer: Writer) -> Path:
    """A file the command writes (the rule: Writer): a regular file or nothing in a writable place, and if it exists
    one `writer` wrote. Returns the path."""
    p = Path(path).expanduser()
    _writable_place(flag, p)
    if p.exists() and not writer.wrote(p):
        raise writer._foreign(flag, p)
    return p


def output_files(flag: str, result: str | Path, writer: Writer, companions: Sequence[str | Path] = ()) -> List[Path]:
    """A result file and the files written with it (its markdown, its figure), by the rule (Writer): a companion is
    replaced when it carries the marker or the result is recognised. A CSV result carries no marker: it is recognised
    by the markdown of the same stem among the companions. Returns the paths, the result first."""
    main = Path(result).expanduser()
    paths = [main] + [Path(c).expanduser() for c in companions]
    for p in paths:
        _writable_place(flag, p)
    main_ours = False
    if main.exists():
        if main.suffix.lower() == ".csv":
            md = main.with_suffix(".md")
            if not (md in paths and md.exists() and first_line(md) == writer.markdown_marker):
                raise writer._foreign(flag, main)
        elif not writer.wrote(main):
            raise writer._foreign(flag, main)
        main_ours = True
    for p in paths[1:]:
        if p.exists() and not (main_ours or writer.wrote(p)):
            raise writer._foreign(flag, p)
    return paths


def output_stem(flag: str, out: str | Path, writer: Writer, siblings: Sequence[str] = (".md", ".png")) -> List[Path]:
    """A stem-like --out (a reproduction script's, the WAN meter's): `<out>.json` (or `out` itself when it ends in
    .csv) and each sibling suffix beside it, by output_files. `out` itself must not be a device or a pipe (--out
    /dev/null once wrote /dev/null.json, .md and .png into /dev)."""
    given = Path(out).expanduser()
    try:
        special = _is_special(given)
    except OSError as e:
        raise unchecked(flag, given, e) from None
    if special:
        raise _not_regular(flag, given)
    main = given if given.suffix.lower() in (".json", ".csv") else given.with_suffix(".json")
    return output_files(flag, main, writer, [main.with_suffix(s) for s in siblings])


def output_folder(flag: str, path: str | Path) -> Path:
    """A folder the command writes: not an existing file, no part of its parent path a file, and writable (itself
    when it exists, else the nearest existing folder above it)."""
    p = Path(path).expanduser()
    try:
        if p.exists() and not p.is_dir():
            raise ArgumentError(f"{flag} {p} is a file; give the path of a folder to write")
        if p.is_symlink() and not p.exists():
            raise ArgumentError(f"{flag} {p} is a symbolic link to nothing (or a loop); give the path of a folder")
        if p.is_dir():
            _check_writable(flag, p, p)
        else:
            _nearest_folder(flag, p)
    except OSError as e:
        raise unchecked(flag, p, e) from None
    return p


def _writable_place(flag: str, p: Path) -> None:
    """`p` is nothing or a regular file, and the nearest existing folder above it is a writable folder."""
    try:
        if p.is_dir():
            raise ArgumentError(f"{flag} {p} is a folder; give the path of a file to write")
        if _is_special(p):  # an atomic write would put a file in the place of /dev/null
            raise _not_regular(flag, p)
        if p.is_symlink() and not p.exists():
            raise ArgumentError(f"{flag} {p} is a symbolic link to nothing (or a loop); give the path of a file to "
                                "write")
        _nearest_folder(flag, p)
    except OSError as e:
        raise unchecked(flag, p, e) from None


def unchecked(flag: str, p: Path, e: OSError) -> ArgumentError:
    """The refusal of a path that could not even be looked at (a name too long, a loop in its parent path)."""
    if e.errno == errno.ENAMETOOLONG:
        return ArgumentError(f"{flag} {p}: a name in this path is longer than the file system allows (255 bytes on "
                             "most); shorten it")
    return ArgumentError(f"{flag} {p}: cannot be checked ({e.strerror or e})")


def _nearest_folder(flag: str, p: Path) -> None:
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArgumentError(f"{flag} {p}: {parent} is a file, not a folder")
            _check_writable(flag, p, parent)
            return


def _check_writable(flag: str, p: Path, folder: Path) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ArgumentError(f"{flag} {p}: the folder {folder} is not writable; choose another place")


def _is_special(p: Path) -> bool:
    return p.exists() and not p.is_file() and not p.is_dir()


def _not_regular(flag: str, p: Path) -> ArgumentError:
    return ArgumentError(f"{flag} {p} is not a regular file (a device or a pipe?); give the path of a file to write")


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
