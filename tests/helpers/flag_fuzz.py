"""The flag fuzzer of tests/test_flag_fuzz.py: finds every command-line entry point, takes its parser, and knows
for each option which values are bad (and which are legitimate) from the option itself: argparse's `choices`,
`nargs` and the flag's type from nanotron_ext.cli_flags, whose fields (low, high, format, writer) say what it
accepts. A case runs the entry point's `main(argv)` in this process, its output captured as a terminal would
print it, with the current folder a sandbox whose files are compared before and after."""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

from nanotron_ext import cli_flags as cf
from tests.helpers import fuzz_values as fv

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "config_tiny_llama.yaml"
BAD_UTF8 = fv.BAD_UTF8
SCRIPT_DIRS = ("reproduce", "benchmarks", "scripts")
CASE_LIMIT_S = 20.0  # a refusal takes milliseconds; a case still running after this started real work


# -- entry points -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EntryPoint:
    name: str  # "nanotron_ext.plan" (python -m) or "reproduce/boost/table3_grouping.py" (python <file>)
    source: Path

    @property
    def argv0(self) -> List[str]:
        """The command line that runs it."""
        return ["-m", self.name] if not self.name.endswith(".py") else [str(REPO / self.name)]

    def load(self) -> ModuleType:
        if not self.name.endswith(".py"):
            module = self.name if self.source.name != "__main__.py" else f"{self.name}.__main__"
            return importlib.import_module(module)
        name = "fuzz_" + self.name.removesuffix(".py").replace("/", "_")
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, self.source)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


def _runs_as_main(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def _defines_main(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def entry_points() -> Tuple[List[EntryPoint], Dict[str, str]]:
    """(every entry point with its own main, {shim: the module whose main it runs}): the package's modules run with
    python -m (a __main__ guard, or a package's __main__.py) and the scripts under reproduce/, benchmarks/, scripts/."""
    found: List[EntryPoint] = []
    shims: Dict[str, str] = {}
    files = sorted((REPO / "nanotron_ext").rglob("*.py")) + sorted(
        p for d in SCRIPT_DIRS for p in (REPO / d).rglob("*.py") if "results" not in p.relative_to(REPO).parts)
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        if not (_runs_as_main(tree) or path.name == "__main__.py"):
            continue
        rel = path.relative_to(REPO)
        if rel.parts[0] == "nanotron_ext":
            parts = list(rel.with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
        else:
            name = str(rel)
        if not _defines_main(tree):
            target = next((n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                           and any(a.name == "main" for a in n.names)), None)
            shims[name] = target or ""
            continue
        found.append(EntryPoint(name, path))
    return found, shims


def parser_of(main: Callable[..., Any]) -> Optional[argparse.ArgumentParser]:
    """The parser `main` parses its arguments with: the first one that parses while it handles --help."""
    seen: List[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def spy(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        seen.append(self)
        return original(self, *a, **k)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", spy), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["--help"])
        except SystemExit:
            pass
    return seen[0] if seen else None


# -- options -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    entry: EntryPoint
    prefix: Tuple[str, ...]  # the subcommand, e.g. ("prepare",)
    action: argparse.Action
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        """As the test ids and the exception tables write it: the longest option string, or a positional's dest."""
        a = self.action
        flag = max(a.option_strings, key=len) if a.option_strings else a.dest
        return " ".join([*self.prefix, flag])

    @property
    def names(self) -> Tuple[str, ...]:
        """What a refusal may call it."""
        a = self.action
        return tuple(a.option_strings) or tuple(str(x) for x in (a.metavar, a.dest) if x)

    @property
    def internal(self) -> bool:
        """Hidden from --help: set by the command for its own worker processes, never by a user."""
        return self.action.help == argparse.SUPPRESS

    @property
    def takes_value(self) -> bool:
        return self.action.nargs != 0

    def tokens(self, value: str) -> List[str]:
        """The option with `value` on the command line (--flag=VALUE: a value such as -inf is not taken for a flag)."""
        a = self.action
        if not a.option_strings:
            return [value]
        flag = max(a.option_strings, key=len)
        if isinstance(a.nargs, int) and a.nargs > 1:
            return [flag] + [value] * a.nargs
        return [f"{flag}={value}"]


def options(entry: EntryPoint, parser: argparse.ArgumentParser, prefix: Tuple[str, ...] = ()) -> Iterator[Option]:
    """Every option of `parser` and of its subcommands' parsers (help actions left out)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from options(entry, sub, (*prefix, name))
            continue
        yield Option(entry, prefix, action, parser)


# -- the sandbox: paths with every problem a path can have ---------------------------------------------------------
class Sandbox:
    """A folder of fixtures, the current folder while a case runs. Nothing in it may change."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "folder").mkdir(exist_ok=True)
        (root / "folder.json").mkdir(exist_ok=True)  # a folder where a stem's JSON goes
        (root / "plain.txt").write_text("some text\n")
        (root / "ok.json").write_text("{}\n")
        (root / "ok.jsonl").write_text('{"text": "hello"}\n')
        (root / "foreign.json").write_text('{"final_val_loss": 4.2}\n')  # a run's summary.json: never replaced
        for name, target in (("loop", "loop"), ("dangling", "nowhere/at/all"), ("stem_loop.json", "stem_loop.json")):
            if not os.path.lexists(root / name):
                os.symlink(target, root / name)
        if not (root / "fifo").exists():
            os.mkfifo(root / "fifo")
        ro = root / "read_only"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        for name in ("unreadable.json", "unreadable_dir"):
            p = root / name
            if name.endswith("_dir"):
                p.mkdir(exist_ok=True)
            else:
                p.write_text("{}\n")
            p.chmod(0)

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    def snapshot(self) -> Dict[str, Tuple[int, int, int]]:
        """Every entry below the root: (mode, size, mtime) without following links (the loop is one)."""
        out: Dict[str, Tuple[int, int, int]] = {}
        for folder, dirs, files in os.walk(self.root):
            for name in dirs + files:
                p = os.path.join(folder, name)
                st = os.lstat(p)
                out[os.path.relpath(p, self.root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
        return out


ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0  # root reads a chmod 000 file and writes a 555 folder


def permission_values(opt: Option, box: Sandbox) -> List[Tuple[str, str]]:
    """The bad values that only permissions make bad: an unreadable file or folder, a read-only folder."""
    make = fv.PERMISSION.get(type(opt.action.type))
    return make(box.root) if make else []


def bad_values(opt: Option, box: Sandbox) -> List[Tuple[str, str]]:
    """(what, value) pairs the option must refuse, by its choices or its type; [] for a flag without a value."""
    a = opt.action
    if not opt.takes_value:
        return []
    if a.choices is not None:
        return [("not a choice", "no-such-choice"), ("empty", "")] + fv.COMMON_BAD
    try:
        return fv.bad_for_type(a.type, box.root)
    except TypeError as e:
        raise TypeError(f"{opt.entry.name} {opt.name}: {e}") from None


def good_values(opt: Option, box: Sandbox) -> List[str]:
    """Values the option accepts (a count's lowest, an output still to be created)."""
    if opt.action.choices is not None:
        return [str(next(iter(opt.action.choices)))]
    return fv.good_for_type(opt.action.type, box.root)


BASE_VALUES: Dict[Tuple[str, str], str] = {}  # (entry, option) -> a good value of a required untyped option


def base_value(opt: Option, box: Sandbox) -> str:
    """A value that passes the option's checks, for a required option while another one is fuzzed."""
    if (opt.entry.name, opt.name) in BASE_VALUES:
        return BASE_VALUES[(opt.entry.name, opt.name)]
    values = good_values(opt, box)
    if not values:
        raise TypeError(f"{opt.entry.name} {opt.name}: required, and no value is known to pass its checks")
    return values[-1] if isinstance(opt.action.type, (cf.Int, cf.Float)) else values[0]


def argv_for(opt: Option, value_tokens: List[str], all_opts: List[Option], box: Sandbox,
             tail: List[str]) -> List[str]:
    """The subcommand, every other required option with a good value, the fuzzed option, the positionals, `tail`."""
    flags: List[str] = []
    positionals: List[str] = []
    for other in all_opts:
        if other.prefix != opt.prefix or not other.action.required:
            continue
        if other.action is opt.action:
            (flags if other.action.option_strings else positionals).extend(value_tokens)
        elif other.action.option_strings:
            flags += other.tokens(base_value(other, box))
        elif other.action.nargs != argparse.REMAINDER and not tail:
            positionals += other.tokens(base_value(other, box))
    if not opt.action.required:
        (flags if opt.action.option_strings else positionals).extend(value_tokens)
    return [*opt.prefix, *flags, *positionals, *tail]


# -- running a case ------------------------------------------------------------------------------------------------
class StartedWork(BaseException):
    """A case got past its checks and started real work (a process, or more than CASE_LIMIT_S of it)."""


@dataclass
class Outcome:
    code: Any
    out: str
    err: str
    seconds: float
    changed: List[str] = field(default_factory=list)
    started: Optional[str] = None


def _terminal() -> io.TextIOWrapper:
    # as a terminal's stream: bytes that are not UTF-8 are printed escaped, not an error of the capture
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)


def _read(stream: io.TextIOWrapper) -> str:
    return stream.buffer.getvalue().decode("utf-8")


@contextlib.contextmanager
def _no_real_work(limit_s: float) -> Iterator[None]:
    """Starting a process, or running past `limit_s`, raises StartedWork (pytest-timeout's own alarm is kept)."""
    def stop(*_a: Any, **_k: Any) -> None:
        raise StartedWork("started a process")

    def too_long(*_a: Any) -> None:
        raise StartedWork(f"still running after {limit_s:g} s")

    outer_handler = signal.getsignal(signal.SIGALRM)
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with mock.patch.object(subprocess.Popen, "__init__", stop), \
                mock.patch("multiprocessing.process.BaseProcess.start", stop):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 0.001))


@contextlib.contextmanager
def _logs_to(stream: io.TextIOWrapper) -> Iterator[None]:
    """Every logging handler that writes to a terminal stream writes to `stream` meanwhile: a warning logged on the
    way to a refusal is a second line on the user's terminal (handlers keep the stream they were made with)."""
    import logging

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    swapped = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if type(handler) is logging.StreamHandler:  # (not a FileHandler: a log file is no terminal)
            swapped.append((handler, _set_stream(handler, stream)))
    root, saved = logging.getLogger(), logging.getLogger().handlers[:]
    if all(type(h).__module__.startswith("_pytest") for h in saved):  # as a command runs: logging's last resort
        last_resort = logging.StreamHandler(stream)
        last_resort.setLevel(logging.WARNING)
        root.handlers = [last_resort]
    try:
        yield
    finally:
        root.handlers = saved
        for handler, old in swapped:
            _set_stream(handler, old)


def _set_stream(handler: Any, stream: Any) -> Any:
    """handler.setStream(stream), for a handler whose stream may be closed: a library that made its handler on first
    use (transformers, huggingface_hub) bound it to the sys.stderr of that moment, an earlier test's capture, closed
    since; setStream would flush that closed file and raise."""
    try:
        return handler.setStream(stream)
    except ValueError:  # "I/O operation on closed file": nothing to flush, swap it as setStream would
        old, handler.stream = handler.stream, stream
        return old


def run_case(main: Callable[..., Any], argv: List[str], box: Sandbox, limit_s: float = CASE_LIMIT_S) -> Outcome:
    """main(argv) in the sandbox: its exit code, stdout, stderr, time, and what it changed there."""
    before = box.snapshot()
    out, err = _terminal(), _terminal()
    cwd = os.getcwd()
    # the trainer's main takes SIGTERM and SIGINT and ignores them on its way out: the test process keeps its own
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)  # (a launcher that got past its checks sets variables for its workers)
    start = time.monotonic()
    started = None
    code: Any = None
    os.chdir(box.root)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _logs_to(err), _no_real_work(limit_s):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    except StartedWork as e:
        started = str(e)
    except Exception as e:  # noqa: BLE001 - a traceback is what the case reports
        import traceback

        err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception(e)))
    finally:
        os.chdir(cwd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
    after = box.snapshot()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return Outcome(code, _read(out), _read(err), time.monotonic() - start, changed, started)


def refusal_problem(outcome: Outcome, names: Tuple[str, ...]) -> Optional[str]:
    """Why `outcome` is not a refusal: exit code 2, one line on stderr naming one of `names`, no traceback, nothing
    changed in the sandbox; None when it is one."""
    if outcome.started:
        return f"accepted: {outcome.started}"
    lines = outcome.err.splitlines()
    if "Traceback" in outcome.err:
        return "a traceback: " + " | ".join(lines[-3:])
    if outcome.code != 2:
        return f"exit code {outcome.code!r} (stderr: {' | '.join(lines[-2:])!r})"
    if len(lines) != 1 or not outcome.err.endswith("\n"):
        return f"{len(lines)} lines on stderr: {' | '.join(lines[:4])!r}"
    if not lines[0].startswith("error: "):
        return f"not an error line: {lines[0]!r}"
    if not any(n in lines[0] for n in names):
        return f"does not name {' or '.join(names)}: {lines[0]!r}"
    if outcome.changed:
        return f"changed {outcome.changed}"
    return None
