"""Issue 41 item 2: every flag of every command-line entry point, fuzzed. Each entry point's parser is taken from
the entry point itself (its main(["--help"])) and each option tried with the values its type says are bad:
negative, zero, NaN, inf, text for a number, empty, invalid UTF-8, a missing path, a folder, a device, a FIFO, a
symbolic link loop, a file it did not write, an unreadable file (skipped as root, who reads it anyway). Each must
end with exit code 2 and one line on stderr naming the flag, no traceback, nothing changed in the sandbox folder it
ran in, and before any work. What is bad is read from the option (tests/helpers/flag_fuzz.py): argparse's choices
and nargs, and the flag types of nanotron_ext.cli_flags, whose fields (low, high, low_open, format, writer) say
what they accept; a new flag is covered without editing this file, and one whose value has no such type fails
here until it gets one or joins UNTYPED with the reason. The files a command reads are fuzzed too (below)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

from nanotron_ext import cli_flags as cf
from tests.helpers import flag_fuzz as ff

ENTRIES, SHIMS = ff.entry_points()
BY_NAME = {e.name: e for e in ENTRIES}

# Entry points without a parser, and why.
NO_PARSER: Dict[str, str] = {
    "scripts/torchft_smoke.py": "takes no arguments (a fixed smoke test of torchft on localhost)",
}

# Options whose value no flag type describes, and why they are not fuzzed by type.
UNTYPED: Dict[Tuple[str, str], str] = {
    ("nanotron_ext.launch", "training_script"): "torchrun's script or module (-m): the launcher runs the trainer's "
                                                "own checks on it (its pre-flight)",
    ("nanotron_ext.launch", "training_script_args"): "the trainer's own arguments, fuzzed as nanotron_ext.train",
}
# torchrun's own options that nanotron_ext.launch passes to torch unchanged: torch reads them (rendezvous, logs,
# filters); the ones this launcher checks itself have flag types (launch.torchrun_parser)
TORCHRUN_UNTYPED = {"--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--event-log-handler", "--role",
                    "--redirects", "--tee", "--local-ranks-filter", "--duplicate-stdout-filters",
                    "--duplicate-stderr-filters", "--master-addr", "--local-addr", "--logs-specs",
                    "--signals-to-handle"}
UNTYPED.update({("nanotron_ext.launch", f): "torchrun's own option, passed to torch unchanged (torch checks it)"
                for f in TORCHRUN_UNTYPED})

UNTYPED.update({
    ("nanotron_ext.bench.slow_link", "--setting"): "its own type (parse_setting, NAME:key=value,...): EXPLICIT values",
    ("benchmarks/gpu_check_jobs.py", "--results"): "the JSONL gpu_check.py's worker appends rows to, named by "
                                                   "gpu_check.py in its work folder, never by a user",
    ("scripts/gpu_wheels.py", "--dest"): "STANDALONE: the wheel folder (fill writes it, install reads it)",
    ("scripts/gpu_wheels.py", "--site"): "STANDALONE: pip's --target folder",
})
# bad values of untyped options
EXPLICIT: Dict[Tuple[str, str], List[Tuple[str, str]]] = {
    ("nanotron_ext.bench.slow_link", "--setting"): [("empty", ""), ("no name", ":a=b"), ("an item without =", "x:y"),
                                                    ("invalid UTF-8", ff.BAD_UTF8)],
}
ff.BASE_VALUES.update({("nanotron_ext.bench.slow_link", "--setting"): "base:model.num_layers=2",
                       ("benchmarks/gpu_check_jobs.py", "--results"): "rows.jsonl"})
# scripts that run before this package is installed (a GPU machine's bare python): their parser cannot be a
# cli_flags.Parser, but keeps its rule (one line, exit code 2)
STANDALONE = {"scripts/gpu_wheels.py": "install runs on a bare python, before nanotron_ext is installed"}

# what follows the fuzzed option on a command line that needs more than its required options
TAIL: Dict[str, List[str]] = {"nanotron_ext.launch": ["-m", "nanotron_ext.train", "--config-file", str(ff.TINY)],
                              "reproduce/het_sparseloco/sim_sweep.py": ["--variant", "dense"]}  # (else refused first)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> ff.Sandbox:
    return ff.Sandbox(tmp_path_factory.mktemp("fuzz_box"))


_PARSERS: Dict[str, argparse.ArgumentParser] = {}


def _options(name: str) -> List[ff.Option]:
    entry = BY_NAME[name]
    if name not in _PARSERS:
        parser = ff.parser_of(entry.load().main)
        assert parser is not None, f"{name}: main(['--help']) parsed nothing"
        _PARSERS[name] = parser
    return list(ff.options(entry, _PARSERS[name]))


FUZZED = sorted(n for n in BY_NAME if n not in NO_PARSER)


def test_every_entry_point_is_found() -> None:
    # the shims run the main of an entry point found here (python -m nanotron_ext.bench.wan)
    assert {"nanotron_ext.launch", "nanotron_ext.train", "nanotron_ext.data", "nanotron_ext.config",
            "nanotron_ext.plan", "nanotron_ext.export", "nanotron_ext.eval", "nanotron_ext.generate",
            "nanotron_ext.bench.wan.cli", "nanotron_ext.sparseloco.ft_launch"} <= set(BY_NAME)
    assert sum(n.startswith("reproduce/") for n in BY_NAME) >= 30
    for shim, target in SHIMS.items():
        assert target in BY_NAME, f"{shim} runs the main of {target!r}, which is no entry point found"
    assert set(NO_PARSER) <= set(BY_NAME), "NO_PARSER names an entry point that is gone"


@pytest.mark.parametrize("name", FUZZED)
def test_every_option_has_a_type_that_says_what_it_accepts(name: str) -> None:
    opts = _options(name)
    for opt in opts:
        assert name in STANDALONE or isinstance(opt.parser, cf.Parser), (
            f"{name} {' '.join(opt.prefix)}: its parser is no nanotron_ext.cli_flags.Parser (one-line errors)")
    for opt in opts:
        if opt.internal or not opt.takes_value or opt.action.choices is not None:
            continue
        if (name, opt.name) in UNTYPED:
            assert not isinstance(opt.action.type, cf.FLAG_TYPES), f"{name} {opt.name}: typed now, drop from UNTYPED"
            continue
        assert isinstance(opt.action.type, cf.FLAG_TYPES), (
            f"{name} {opt.name}: type={opt.action.type!r}; give it a nanotron_ext.cli_flags type (what its value "
            "may be is then checked when parsed, and fuzzed here), or add it to UNTYPED with the reason")


def test_the_tables_name_existing_options() -> None:
    names = {(n, o.name) for n in FUZZED for o in _options(n)}
    assert set(UNTYPED) <= names, sorted(set(UNTYPED) - names)


def _cases(name: str, box: ff.Sandbox) -> List[Tuple[ff.Option, str, str]]:
    out = []
    for opt in _options(name):
        if opt.internal:
            continue
        values = EXPLICIT.get((name, opt.name), []) if (name, opt.name) in UNTYPED else ff.bad_values(opt, box)
        out += [(opt, what, value) for what, value in values]
    return out


@pytest.mark.parametrize("name", FUZZED)
def test_bad_values_are_one_line_and_exit_2_before_any_work(name: str, box: ff.Sandbox) -> None:
    opts = _options(name)
    main = BY_NAME[name].load().main
    problems = []
    for opt, what, value in _cases(name, box):
        argv = ff.argv_for(opt, opt.tokens(value), opts, box, TAIL.get(name, []))
        outcome = ff.run_case(main, argv, box)
        problem = ff.refusal_problem(outcome, opt.names)
        if problem:
            problems.append(f"{opt.name} {what} ({value!r}): {problem}")
    for opt in opts:  # a flag without a value given one
        if not opt.takes_value and opt.action.option_strings and not opt.internal:
            flag = max(opt.action.option_strings, key=len)
            outcome = ff.run_case(main, ff.argv_for(opt, [f"{flag}=x"], opts, box, TAIL.get(name, [])), box)
            problem = ff.refusal_problem(outcome, opt.names)
            if problem:
                problems.append(f"{opt.name}=x: {problem}")
    assert not problems, f"{name}: {len(problems)} bad values not refused:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", FUZZED)
def test_values_a_flag_accepts_pass_its_type(name: str, box: ff.Sandbox) -> None:
    """The other side: the legitimate values by the same fields (a count's lowest, an output still to be created, a
    missing parent folder, a file its writer wrote) pass the type."""
    problems = []
    for opt in _options(name):
        if opt.action.type is None or not isinstance(opt.action.type, cf.FLAG_TYPES):
            continue
        values = ff.good_values(opt, box)
        if isinstance(opt.action.type, (cf.OutputFile, cf.OutputStem)):
            ours = box / f"ours_{abs(hash(opt.name))}.json"
            opt.action.type.writer.write_json(ours, {"rows": [], "meta": {}})
            values.append(str(ours) if isinstance(opt.action.type, cf.OutputFile) else str(ours.with_suffix("")))
        for value in values:
            try:
                opt.action.type(value)
            except argparse.ArgumentTypeError as e:
                problems.append(f"{opt.name} {value!r}: {e}")
    assert not problems, f"{name}: legitimate values refused:\n" + "\n".join(problems)


@pytest.mark.skipif(ff.ROOT_USER, reason="run as root: chmod 000 does not stop root reading a file, nor 555 writing "
                                         "into a folder, so the unreadable and read-only cases cannot be made")
@pytest.mark.parametrize("name", FUZZED)
def test_unreadable_and_read_only_paths_are_refused(name: str, box: ff.Sandbox) -> None:
    opts = _options(name)
    main = BY_NAME[name].load().main
    problems = []
    for opt in opts:
        if opt.internal or (name, opt.name) in UNTYPED:
            continue
        for what, value in ff.permission_values(opt, box):
            outcome = ff.run_case(main, ff.argv_for(opt, opt.tokens(value), opts, box, TAIL.get(name, [])), box)
            problem = ff.refusal_problem(outcome, opt.names)
            if problem:
                problems.append(f"{opt.name} {what}: {problem}")
    assert not problems, "\n".join(problems)


# a sample on the real command line: the in-process harness sees what a user sees (exit code 2, the one line)
SAMPLE = [("nanotron_ext.plan", ["--config-file", str(ff.TINY), "--gpu-memory=nan"]),  # a number
          ("reproduce/boost/fig6_scaling.py", ["--out=folder"]),  # a path (folder.json is a folder), a script
          ("nanotron_ext.launch", ["--max-restarts=-1", "-m", "nanotron_ext.train", "--config-file", str(ff.TINY)])]


def test_the_command_line_says_what_the_harness_saw(box: ff.Sandbox) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def real(name: str, argv: List[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *BY_NAME[name].argv0, *argv], cwd=box.root, capture_output=True,
                              text=True, timeout=120, errors="backslashreplace")

    with ThreadPoolExecutor(max_workers=2) as pool:  # two at a time: the suite shares two cores
        got = list(pool.map(lambda case: real(*case), SAMPLE))
    for (name, argv), proc in zip(SAMPLE, got):
        inside = ff.run_case(BY_NAME[name].load().main, argv, box)
        assert proc.returncode == inside.code == 2, (name, proc.returncode, inside.code, proc.stderr[-2000:])
        assert proc.stderr == inside.err and proc.stderr.count("\n") == 1, (name, proc.stderr, inside.err)
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: --"), proc.stderr
