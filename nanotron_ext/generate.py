"""python -m nanotron_ext.generate --run runs/<run> --prompt "..."
       [--max-new-tokens N --temperature T --top-p P --seed S]

Continues a prompt with a run's checkpoint (any layout, any technique) on one process and prints the text as it
comes. The prompt is tokenised with the run's tokenizer after the document separator `<|endoftext|>` (what
precedes every document in training); generation stops at the next separator, after --max-new-tokens, or at
model.max_seq_len tokens in all. Backend `auto` uses the model's transformers twin with a KV cache when the model
has a dense equivalent and transformers is installed, else our own model (no cache); --temperature 0 is greedy.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import List, Optional

from nanotron_ext.export import add_run_args


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_flags import SEED, Float, Int, Parser, Text
    from nanotron_ext.errors import UserFacingError, one_line

    parser = Parser(prog="python -m nanotron_ext.generate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.add_argument("--prompt", required=True, type=Text(), help="text to continue")
    parser.add_argument("--max-new-tokens", type=Int(1), default=64)
    parser.add_argument("--temperature", type=Float(0.0), default=0.8, help="0 = greedy")  # (nan passed `< 0`)
    parser.add_argument("--top-p", type=Float(0.0, 1.0, low_open=True), default=0.95,
                        help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--backend", choices=("auto", "native", "hf"), default="auto",
                        help="hf: transformers with a KV cache (standard models); native: our model; "
                             "auto: hf when possible")
    args = parser.parse_args(argv)
    try:
        from nanotron_ext.inference.model import one_process_group

        with one_process_group():
            run_generation(args)
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    return 0


def run_generation(args: argparse.Namespace) -> List[int]:
    from nanotron_ext.data.prepare import load_tokenizer
    from nanotron_ext.errors import UserFacingError
    from nanotron_ext.hf.tokenizer import eos_id
    from nanotron_ext.inference.generation import generate, hf_next_logits, native_next_logits
    from nanotron_ext.inference.run import gather, read_live

    want_hf = args.backend == "hf" or (args.backend == "auto" and importlib.util.find_spec("transformers") is not None)
    ckpt, (tok_path, got) = read_live(args.run, args.step, args.checkpoints, lambda c: (
        c.tokenizer_path(args.tokenizer), gather(c, replica=args.replica, dense=want_hf)))
    tokenizer, eos = load_tokenizer(tok_path), eos_id(tok_path)
    cfg = ckpt.config.model
    if args.backend == "hf" and got.refusal is not None:
        raise UserFacingError(f"--backend hf: {got.refusal}; use --backend native")
    if want_hf and got.dense is not None:
        from nanotron_ext.hf.export import hf_model

        step, backend = hf_next_logits(hf_model(cfg, got.dense, eos)), "transformers, KV cache"
    else:
        from nanotron_ext.inference.model import load_single_process_model

        step, backend = native_next_logits(load_single_process_model(ckpt, got.raw, args.replica)), "native, no cache"
    prompt = [eos] + tokenizer.encode(args.prompt).ids
    if len(prompt) >= cfg.max_seq_len:
        raise UserFacingError(f"the prompt is {len(prompt)} tokens; model.max_seq_len={cfg.max_seq_len} leaves no room")
    print(f"[{ckpt.run_dir} step {ckpt.step}, {backend}]", file=sys.stderr, flush=True)
    print(args.prompt, end="", flush=True)
    new: List[int] = []
    shown = [""]

    def show(final: bool = False) -> None:  # a byte-level token may be half a character: wait for the rest
        text = tokenizer.decode([t for t in new if t != eos])
        if (final or not text.endswith("\ufffd")) and text.startswith(shown[0]):
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    def record(token: int) -> None:
        new.append(token)
        show()

    generate(step, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
             eos_id=eos, max_length=cfg.max_seq_len, on_token=record)
    show(final=True)
    print(flush=True)
    return new


if __name__ == "__main__":
    sys.exit(main())
