"""`python -m nanotron_ext.data prepare --config-file X.yaml [--set key=value ...]`."""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_flags import InputFile, Int, KeyValue, Parser

    parser = Parser(prog="python -m nanotron_ext.data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="read documents, split, train the tokenizer, write token shards")
    prep.add_argument("--config-file", required=True, type=InputFile(format="yaml"), help="run configuration (YAML)")
    prep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                      help="override a config value, e.g. --set data.source=jsonl (repeatable)")
    prep.add_argument("--max-documents", type=Int(1), default=None,
                      help="read only the first N documents (quick smoke runs)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    prep.add_argument("--verify", action="store_true",
                      help="also check every existing shard's sha256 (not only its size) and rebuild damaged splits")
    args = parser.parse_args(argv)

    from nanotron_ext.config.loader import load_config  # lazy: the YAML loader is its own module
    from nanotron_ext.data.prepare import prepare
    from nanotron_ext.errors import UserFacingError, one_line

    try:
        config = load_config(args.config_file, args.set)
        report = prepare(config, max_documents=args.max_documents, progress=not args.no_progress,
                         verify=args.verify)
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder: the message names the file (prepare names it)
        from nanotron_ext.errors import os_error_line

        hint = "free space there or make the folder writable (or set data.prepared_dir / tokenizer.path)"
        print(f"error: {os_error_line(e, hint, 'data.prepared_dir')}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
