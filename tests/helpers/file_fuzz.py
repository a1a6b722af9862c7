"""Damaged contents for the files a command reads (tests/test_read_file_fuzz.py): what a JSON, YAML or JSON-lines
file holds when it is garbage, binary, cut to nothing, of the wrong shape, missing its keys, or carries a NaN."""
from __future__ import annotations

from typing import Dict, List, Tuple

BINARY = b"\x89PNG\r\n\x1a\n\x00\xff\xfe\x00garbage"
# keys the commands read, each NaN: a result's rows and meta, a meter's runs, a plan's items, a checkpoint's meta
NAN_KEYS = ("rows", "meta", "runs", "items", "deadline", "step", "files", "layout", "config", "splits", "format",
            "model_type", "vocab_size", "hidden_size")

# (what, content, what else a refusal may name besides the file and its flag: the key that is wrong)
CONTENTS: Dict[str, List[Tuple[str, bytes, Tuple[str, ...]]]] = {
    "json": [("garbage", b'{"rows": [1, 2,,', ()), ("binary", BINARY, ()), ("a list", b"[1, 2]", ()),
             ("empty", b"", ()), ("missing keys", b"{}", ()),
             ("NaN", ("{" + ", ".join(f'"{k}": NaN' for k in NAN_KEYS) + "}").encode(), ())],
    "yaml": [("garbage", b"model: [unclosed\n", ()), ("binary", BINARY, ()), ("a list", b"- 1\n- 2\n", ()),
             ("empty", b"", ()), ("an unknown key", b"no_such_section: 1\n", ("no_such_section",)),
             ("NaN", b"optimizer:\n  lr: .nan\n", ("optimizer.lr",))],
    "jsonl": [("garbage", b'{"a": 1}\n{"b": \n', ()), ("binary", BINARY, ()), ("a list on a line", b"[1, 2]\n", ()),
              ("empty", b"", ()), ("missing keys", b"{}\n", ()), ("NaN", b'{"machine": NaN, "torch": NaN}\n', ())],
}
CONTENTS["tokenizer"] = CONTENTS["json"]
