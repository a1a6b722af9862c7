"""The values of tests/test_flag_fuzz.py, read from a flag's type (nanotron_ext.cli_flags): the bad ones it must
refuse (a count's zero and negatives, NaN, inf, text, empty, invalid UTF-8, every way a path can be wrong) and
good ones it must accept (its lowest, an output still to be created). One small function per type; a new type
without one fails the test until it gets them (BAD, GOOD)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from nanotron_ext import cli_flags as cf

Values = List[Tuple[str, str]]  # (what it is, the value)
TINY = Path(__file__).resolve().parents[2] / "examples" / "config_tiny_llama.yaml"
BAD_UTF8 = os.fsdecode(b"caf\xe9")  # Latin-1 bytes on the command line reach Python as a surrogate
COMMON_BAD: Values = [("invalid UTF-8", BAD_UTF8)]
NUMBER_BAD: Values = [("text", "abc"), ("empty", ""), ("NaN", "nan"), ("inf", "inf"), ("-inf", "-inf")]


def num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else repr(float(x))


def _int(t: cf.Int, box: Path) -> Values:
    out = [v for v in NUMBER_BAD if v[1] not in t.words] + [("a fraction", "1.5")] + COMMON_BAD
    out += [("below its lowest", str(t.low - 1))] + [v for v in (("zero", "0"), ("negative", "-1"))
                                                     if int(v[1]) < t.low]
    return out + [("above its highest", str(t.high + 1) if t.high < cf.INT64_MAX else str(2**64))]


def _float(t: cf.Float, box: Path) -> Values:
    out = NUMBER_BAD + COMMON_BAD
    if math.isfinite(t.low):
        out += [("below its lowest", num(t.low - 1))] + ([("its open lowest", num(t.low))] if t.low_open else [])
        out += [v for v in (("zero", "0"), ("negative", "-1")) if float(v[1]) < t.low or float(v[1]) == t.low
                and t.low_open]
    return out + ([("above its highest", num(t.high + 1))] if math.isfinite(t.high) else [])


def _key_value(t: cf.KeyValue, box: Path) -> Values:
    out = COMMON_BAD + [("no =", "novalue"), ("no key", "=1"), ("empty", ""), ("a key with a space", "a b=1")]
    out += [("an unknown key", "no-such-key=1")] if t.keys else []
    key = t.keys[0] if t.keys else "key"
    inner = bad_for_type(t.value, box) if t.value is not None else []
    return out + [(f"a value {what}", f"{key}={value}") for what, value in inner]


def _paths(box: Path, loop: str = "loop") -> Values:
    return COMMON_BAD + [("empty", ""), ("a symbolic link loop", str(box / loop)), ("a FIFO", str(box / "fifo")),
                         ("a device", "/dev/null")]


def _inputs(box: Path) -> Values:
    return _paths(box) + [("missing", str(box / "missing.json")), ("a dangling link", str(box / "dangling")),
                          ("/dev/zero", "/dev/zero"), ("below a file", str(box / "plain.txt" / "x.json"))]


BAD: Dict[type, Callable[[Any, Path], Values]] = {
    cf.Int: _int,
    cf.Float: _float,
    cf.Text: lambda t, box: COMMON_BAD + ([] if t.empty else [("empty", ""), ("blank", " ")]),
    cf.IntRange: lambda t, box: COMMON_BAD + [
        ("empty", ""), ("text", "abc"), ("zero", "0"), ("negative", "-1"), ("NaN", "nan"),
        ("below its lowest", str(t.low - 1)), ("a range backwards", f"{t.low + 1}:{t.low}"), ("three parts", "1:2:3"),
        ("an open range", "1:")],
    cf.KeyValue: _key_value,
    cf.NumberList: lambda t, box: COMMON_BAD + [
        ("empty", ""), ("text", "a,b"), ("an empty item", "1,,2"), ("NaN", "nan"), ("inf", "inf"),
        ("below its lowest", f"{num(max(t.low, 1))},{num(t.low - 1)}")]
    + ([("a fraction", "1.5")] if t.integer else []),
    cf.Regex: lambda t, box: COMMON_BAD + [("empty", ""), ("not a regular expression", "(unclosed")],
    cf.Names: lambda t, box: COMMON_BAD + [("empty", ""), ("an unknown name", "no-such-name"),
                                           ("an unknown name after a good one", f"{t.choices[0]},no-such-name")],
    cf.InputFile: lambda t, box: _inputs(box) + [("a folder", str(box / "folder"))],
    cf.InputPath: lambda t, box: _inputs(box),
    cf.InputFolder: lambda t, box: _paths(box) + [("missing", str(box / "missing")), ("a file", str(box / "plain.txt")),
                                                  ("below a file", str(box / "plain.txt" / "x"))],
    cf.OutputFile: lambda t, box: _paths(box) + [("a folder", str(box / "folder")),
                                                 ("below a file", str(box / "plain.txt" / "out.json")),
                                                 ("a file it did not write", str(box / "foreign.json"))],
    # a stem names <stem>.json, .md and .png: the loop, the folder and the foreign file are its JSON
    cf.OutputStem: lambda t, box: _paths(box, "stem_loop") + [("a folder where its JSON goes", str(box / "folder")),
                                                              ("below a file", str(box / "plain.txt" / "out")),
                                                              ("a file it did not write", str(box / "foreign"))],
    cf.OutputFolder: lambda t, box: _paths(box) + [("a file", str(box / "plain.txt")),
                                                   ("below a file", str(box / "plain.txt" / "out"))],
}

GOOD: Dict[type, Callable[[Any, Path], List[str]]] = {
    cf.Int: lambda t, box: [str(t.low), str(min(t.high, max(t.low, 1)))] + list(t.words),
    cf.Float: lambda t, box: ([num(t.low)] if math.isfinite(t.low) and not t.low_open else [])
    + [num(min(t.high, (t.low if math.isfinite(t.low) else -1.0) + 0.5))],
    cf.Text: lambda t, box: ["x", "é ünïcode"] + ([""] if t.empty else []),
    cf.IntRange: lambda t, box: [str(t.low), f"{t.low}:{t.low + 1}"],
    cf.KeyValue: lambda t, box: [f"{t.keys[0]}=1", f"{t.keys[0]}=2.5"] if t.keys else ["a.b=1", "a=x=y"],
    cf.NumberList: lambda t, box: [num(max(t.low, 1)), f"{num(max(t.low, 1))},{num(max(t.low, 1) + 1)}"]
    + list(t.words),
    cf.Regex: lambda t, box: ["a.b", "^x+$"],
    cf.Names: lambda t, box: [t.choices[0], ",".join(t.choices)],
    cf.InputFile: lambda t, box: [str(TINY if t.format == "yaml" else
                                      box / ("ok.jsonl" if t.format == "jsonl" else "ok.json"))],
    cf.InputFolder: lambda t, box: [str(box / "folder")],
    cf.InputPath: lambda t, box: [str(box / "ok.jsonl"), str(box / "folder")],
    # a missing output is created, with the folders above it
    cf.OutputFile: lambda t, box: [str(box / "new" / "deeper" / "out.json")],
    cf.OutputStem: lambda t, box: [str(box / "new" / "deeper" / "out")],
    cf.OutputFolder: lambda t, box: [str(box / "new" / "deeper"), str(box / "folder")],
}
# the values that only permissions make bad (root reads a chmod 000 file and writes into a 555 folder)
PERMISSION: Dict[type, Callable[[Path], Values]] = {
    cf.InputFile: lambda box: [("unreadable file", str(box / "unreadable.json"))],
    cf.InputPath: lambda box: [("unreadable file", str(box / "unreadable.json"))],
    cf.InputFolder: lambda box: [("unreadable folder", str(box / "unreadable_dir"))],
    cf.OutputFile: lambda box: [("in a read-only folder", str(box / "read_only" / "out.json"))],
    cf.OutputStem: lambda box: [("in a read-only folder", str(box / "read_only" / "out"))],
    cf.OutputFolder: lambda box: [("in a read-only folder", str(box / "read_only" / "out"))],
}


def bad_for_type(t: Any, box: Path) -> Values:
    """The values a flag of type `t` must refuse."""
    if not isinstance(t, cf.FLAG_TYPES):
        raise TypeError(f"type {t!r} is no nanotron_ext.cli_flags type: nothing says which values are bad")
    known = next((c for c in type(t).__mro__ if c in BAD), None)  # a command's subclass is fuzzed as its base
    if known is None:
        raise TypeError(f"no bad values known for the flag type {t!r}: add them to tests/helpers/fuzz_values.py")
    return BAD[known](t, box)


def good_for_type(t: Any, box: Path) -> List[str]:
    """Values a flag of type `t` must accept."""
    known = next((c for c in type(t).__mro__ if c in GOOD), None)
    return GOOD[known](t, box) if known else []


# -- shell and make entry points (tests/test_shell_fuzz.py): values a shell runs if a script or a Makefile pastes,
# evaluates or expands them; each would `touch mark`
def shell_hostile(mark: Path) -> Values:
    return [("command substitution", f"$(touch {mark})"), ("backquotes", f"`touch {mark}`"),
            ("a ;", f"bogus;touch {mark};true"), ("a newline", f"x\ntouch {mark}"), ("a pipe", f"x|touch {mark}"),
            ("arithmetic evaluation", f"BASH_VERSINFO[$(touch {mark})0]"), ("make's shell", f"$(shell touch {mark})"),
            ("a quote", f"x'; touch {mark}; '")]


# a count given to a shell or make variable: what bash's $(( )) or [ -eq ] would misread or overflow
COUNT_HOSTILE: Values = [("negative", "-1"), ("huge", "99999999999999999999"), ("empty", ""), ("text", "abc"),
                         ("a fraction", "1.5"), ("a leading zero (octal to bash)", "08")]
