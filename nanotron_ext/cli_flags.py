"""Every command line's parser and the types of its flags: a bad value is refused while the arguments are parsed,
before any work, as one line `error: --flag VALUE: why` and exit code 2 (argparse's own errors too: no usage block).

Each type is a frozen dataclass whose fields say what it accepts (tests/test_flag_fuzz.py reads them to know which
values are bad for a flag and which are legitimate); its checks are cli_checks' (at_least, finite, utf8_text,
input_file, output_file, output_stem, output_folder: the rule of every written file), so a flag and a
check of a computed default say the same thing.

    parser = Parser(prog="python -m nanotron_ext.eval")
    parser.add_argument("--batch-size", type=Int(1), default=None)
    parser.add_argument("--json", type=OutputFile(EVAL), default=None)
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence, Tuple

from nanotron_ext.cli_checks import (
    ArgumentError,
    Writer,
    at_least,
    finite,
    input_file,
    output_file,
    output_folder,
    output_stem,
    refuse,
    utf8_text,
)
from nanotron_ext.errors import UserFacingError

INT64_MAX = 2**63 - 1  # what torch and numpy take (seeds, counts handed to C++)
_FLAG = "\x00flag"  # stands for the flag in a cli_checks message; the parser puts the real one in its place


class FlagValueError(argparse.ArgumentTypeError):
    """A value a flag's type refused; the message starts with the value, the parser writes the flag before it."""


class Parser(argparse.ArgumentParser):
    """argparse's parser whose every error is one line on stderr, `error: --flag VALUE: why` (a type's refusal) or
    `error: --flag: argparse's reason`, and exit code 2: argparse printed a usage block first, and a value only
    found bad after parsing was a traceback or, worse, hours of work later. Subparsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exit_on_error", False)  # errors come back here as exceptions, with the flag apart
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None) -> Tuple[argparse.Namespace, list]:
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            flag = max((e.argument_name or "").split("/"), key=len)  # one name of --nproc-per-node/--nproc_per_node
            if isinstance(e.__context__, FlagValueError):  # raised inside the type's call: its own words
                self.error(f"{flag} {e.message}")
            self.error(f"{flag}: {e.message}" if flag else e.message)

    def error(self, message: str) -> NoReturn:  # argparse's own errors (a missing or unknown flag) end here too
        refuse(message)


def one_line_refusals(main: Callable[..., Any]) -> Callable[..., Any]:
    """A command's main(argv) whose user-facing error (a config, a file it reads, an argument checked after
    parsing) ends it as `refuse` does: one line, exit code 2, instead of a traceback."""
    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except UserFacingError as e:
            refuse(e)
    return run


def _checked(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A cli_checks check of a flag's value, its ArgumentError as this flag type's refusal."""
    try:
        return check(_FLAG, *args, **kwargs)
    except ArgumentError as e:
        raise FlagValueError(str(e).removeprefix(_FLAG).lstrip(" ")) from None


def _shown(text: str) -> str:
    """The value as a message shows it: quoted when empty or made of spaces."""
    return repr(text) if not text.strip() else text


@dataclass(frozen=True)
class Int:
    """An integer in [low, high]; `words` are other values taken as they are (torchrun's --nproc_per_node auto)."""

    low: int = 1
    high: int = INT64_MAX
    words: Tuple[str, ...] = ()

    def __call__(self, text: str) -> Any:
        if text in self.words:
            return text
        _checked(utf8_text, text)
        try:
            value = int(text)
        except ValueError:
            other = f" or one of {', '.join(self.words)}" if self.words else ""
            raise FlagValueError(f"{_shown(text)}: not an integer{other}") from None
        _checked(at_least, value, self.low)
        if value > self.high:
            raise FlagValueError(f"{value}: must be " + ("< 2^63" if self.high == INT64_MAX else f"<= {self.high}"))
        return value


SEED = Int(0)  # what torch's and numpy's generators take: [0, 2^63)


@dataclass(frozen=True)
class IntRange:
    """A count N, or a range MIN:MAX with low <= MIN <= MAX (torchrun's --nnodes 1:4); returns the text."""

    low: int = 1

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        parts = text.split(":")
        if len(parts) > 2 or not all(p.isdigit() for p in parts) or not all(int(p) >= self.low for p in parts) \
                or int(parts[0]) > int(parts[-1]):
            raise FlagValueError(f"{_shown(text)}: must be a count >= {self.low} or a range MIN:MAX with "
                                 f"{self.low} <= MIN <= MAX")
        return text


@dataclass(frozen=True)
class Float:
    """A finite number in [low, high] ((low, high] with `low_open`): NaN and infinities are refused."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False

    def __call__(self, text: str) -> float:
        _checked(utf8_text, text)
        try:
            value = float(text)
        except ValueError:
            raise FlagValueError(f"{_shown(text)}: not a number") from None
        _checked(finite, value, self.low, self.high, low_open=self.low_open)
        return value


@dataclass(frozen=True)
class Text:
    """UTF-8 text (bytes that are not reach Python as surrogates, which print() and tokenizers fail on), not empty
    unless `empty`."""

    empty: bool = False

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        if not self.empty and not text.strip():
            raise FlagValueError(f"{_shown(text)}: empty; give a value")
        return text


@dataclass(frozen=True)
class KeyValue:
    """`KEY=VALUE` (a config override, a stage's budget): a key without spaces (one of `keys` when given), then
    `=`; `value` checks VALUE."""

    value: Optional[Callable[[str], Any]] = None
    keys: Tuple[str, ...] = ()

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        key, eq, rest = text.partition("=")
        if not eq or not key.strip() or key != key.strip() or " " in key:
            raise FlagValueError(f"{_shown(text)}: must be KEY=VALUE")
        if self.keys and key not in self.keys:
            raise FlagValueError(f"{text}: {key} is not one of {', '.join(self.keys)}")
        if self.value is not None:
            try:
                self.value(rest)
            except FlagValueError as e:
                raise FlagValueError(f"{text}: {key}: {e}") from None
        return text


@dataclass(frozen=True)
class NumberList:
    """Comma-separated numbers, each >= `low` (--batches 1,2,4,8); integers unless not `integer`; `words` are
    other items taken as they are (link_emulation's --emulate-mbps 0,none). Returns the text, which the command
    splits."""

    low: float = 1
    integer: bool = True
    words: Tuple[str, ...] = ()

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        kind = "integers" if self.integer else "numbers"
        for part in text.split(","):
            if part in self.words:
                continue
            try:
                value = int(part) if self.integer else float(part)
            except ValueError:
                raise FlagValueError(f"{_shown(text)}: must be {kind} separated by commas, e.g. 1,2,4") from None
            if not math.isfinite(value) or value < self.low:
                raise FlagValueError(f"{text}: each must be a finite number >= {self.low:g}")
        return text


@dataclass(frozen=True)
class Names:
    """Comma-separated names, each one of `choices` (--strategies megatron,btp); returns the text."""

    choices: Tuple[str, ...]

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        bad = [n for n in text.split(",") if n not in self.choices]
        if bad or not text:
            raise FlagValueError(f"{_shown(text)}: {_shown(bad[0]) if bad else 'nothing'} is not one of "
                                 f"{', '.join(self.choices)} (separated by commas)")
        return text


@dataclass(frozen=True)
class Regex:
    """A regular expression (Python's re): one that does not compile was a traceback after the work began."""

    def __call__(self, text: str) -> str:
        _checked(utf8_text, text)
        try:
            re.compile(text)
        except re.error as e:
            raise FlagValueError(f"{_shown(text)}: not a regular expression ({e})") from None
        if not text:
            raise FlagValueError("'': empty; give a regular expression")
        return text


# -- paths ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PathFlag:
    """A path: not empty (Path("") is the current folder) and UTF-8 (a message or a JSON naming it must print);
    returned as given, or as a Path with `as_path`."""

    def __call__(self, text: str) -> Any:
        if not text.strip():
            raise FlagValueError(f"{_shown(text)}: empty; give a path")
        _checked(utf8_text, text)
        found = self.check(text) or text
        return Path(found) if getattr(self, "as_path", False) else str(found)

    def check(self, text: str) -> Optional[Path]:
        """Refuse `text` (a FlagValueError); the path it names when that is not `text` itself."""
        raise NotImplementedError


@dataclass(frozen=True)
class InputFile(_PathFlag):
    """A file the command reads: a regular, readable file. `format` says what it holds ("yaml", "json", "jsonl",
    "tokenizer" or "" for anything): the command checks the content when it reads it, before any work."""

    format: str = ""
    as_path: bool = False
    checkout: bool = False  # a relative path may also name a file of the checkout (input_file)

    def check(self, text: str) -> Optional[Path]:
        found = _checked(input_file, text, self.checkout)
        return found if found != Path(text).expanduser() else None  # (a file of the checkout)


@dataclass(frozen=True)
class InputFolder(_PathFlag):
    """A folder the command reads (a run, a checkpoint folder): it exists, is a folder, can be listed."""

    as_path: bool = False

    def check(self, text: str) -> None:
        _checked(input_file, text, folder=True)


@dataclass(frozen=True)
class InputPath(_PathFlag):
    """A file or a folder the command reads (eval --data: a jsonl or parquet file, or a save_to_disk folder)."""

    as_path: bool = False

    def check(self, text: str) -> None:
        if os.path.isdir(text):
            _checked(input_file, text, folder=True)
        else:
            _checked(input_file, text)


@dataclass(frozen=True)
class OutputFile(_PathFlag):
    """A file the command writes, by the rule of every written file (cli_checks.Writer, output_file)."""

    writer: Writer
    as_path: bool = False

    def check(self, text: str) -> None:
        _checked(output_file, text, self.writer)


@dataclass(frozen=True)
class OutputStem(_PathFlag):
    """A reproduction script's or the meter's --out: <out>.json, .md and .png by the rule (cli_checks.output_stem)."""

    writer: Writer
    as_path: bool = False

    def check(self, text: str) -> None:
        _checked(output_stem, text, self.writer)


@dataclass(frozen=True)
class OutputFolder(_PathFlag):
    """A folder the command writes (created when missing): cli_checks.output_folder."""

    as_path: bool = False

    def check(self, text: str) -> None:
        _checked(output_folder, text)


CONFIG = InputFile(format="yaml", checkout=True)  # a script's base config: its default names a file of the checkout

FLAG_TYPES = (Int, IntRange, Float, Text, KeyValue, NumberList, Names, Regex, InputFile, InputFolder, InputPath,
              OutputFile, OutputStem, OutputFolder)
"""Every flag type: a flag whose value is not one of these (nor argparse choices) cannot be fuzzed by its type."""
