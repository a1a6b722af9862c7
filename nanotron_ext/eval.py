"""python -m nanotron_ext.eval --run runs/<run> --data FILE.jsonl [--text-key text] [--json OUT]

Loss, perplexity and bits per byte of a run's checkpoint (any layout, any technique; on one process) on local
text: jsonl, parquet or a dataset saved with `save_to_disk`. Windows, tokenisation and loss are the trainer's, so
on the run's own validation documents the loss equals its validation loss; bits per byte compare runs with
different tokenizers. For lm-eval's tasks, export the run (python -m nanotron_ext.export) and run
`lm_eval --model hf --model_args pretrained=DIR ...` (docs/after-training.md).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import InputPath, Int, OutputFile, Parser, Text
from nanotron_ext.export import add_run_args

# --json replaces only scores it wrote (a run's metrics.jsonl given by mistake was once replaced)
EVAL = Writer("python -m nanotron_ext.eval", legacy_keys=("run", "step", "data", "loss", "perplexity",
                                                         "bits_per_byte"))


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.data.sources import input_files
    from nanotron_ext.errors import UserFacingError, one_line
    from nanotron_ext.inference.model import load_single_process_model, one_process_group
    from nanotron_ext.inference.perplexity import data_config, score_text
    from nanotron_ext.inference.run import gather, read_live

    parser = Parser(prog="python -m nanotron_ext.eval", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.add_argument("--data", required=True, type=InputPath(),
                        help="a jsonl or parquet file, or a save_to_disk folder")
    parser.add_argument("--source", choices=("jsonl", "parquet", "hf_disk"), default=None,
                        help="reader (default: from the name)")
    parser.add_argument("--text-key", default="text", type=Text(), help="field holding each document's text")
    parser.add_argument("--batch-size", type=Int(1), default=None,  # 0 scored no window: loss 0, perplexity 1
                        help="windows per forward (default: the run's micro-batch)")
    parser.add_argument("--json", default=None, type=OutputFile(EVAL), help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    try:
        data = data_config(args.data, args.text_key, args.source)
        input_files(data, flag="--data")  # the reader's checks (packages, folder contents, format) before any work
        ckpt, (tok_path, raw) = read_live(args.run, args.step, args.checkpoints, lambda c: (
            c.tokenizer_path(args.tokenizer), gather(c, replica=args.replica).raw))
        tokens = ckpt.config.tokens
        with one_process_group():
            model = load_single_process_model(ckpt, raw, args.replica)
            score = score_text(model, data, tok_path, tokens.sequence_length, args.batch_size
                               or tokens.micro_batch_size)
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    result = {"run": str(ckpt.run_dir), "step": ckpt.step, "data": args.data, **score.as_dict()}
    print(f"{ckpt.run_dir} step {ckpt.step} on {args.data}: {score.documents} documents, {score.bytes:,} bytes, "
          f"{score.tokens:,} tokens ({score.scored_tokens:,} scored in {score.windows} windows of "
          f"{tokens.sequence_length + 1})")
    print(f"loss {score.loss:.4f} nats/token   perplexity {score.perplexity:.2f}   bits per byte "
          f"{score.bits_per_byte:.4f}")
    if args.json:
        try:
            EVAL.write_json(args.json, result)
        except OSError as e:  # a full disk, a read-only folder: the scores are printed above
            print(f"error: --json: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
