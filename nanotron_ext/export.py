"""python -m nanotron_ext.export --run runs/<run> [--step N] [--checkpoints DIR [DIR ...]] --out DIR

Writes a folder transformers loads with `AutoModelForCausalLM.from_pretrained(DIR)`: the run's checkpoint
reassembled from any layout (dp x tp x pp, any TP strategy), as its dense equivalent (BOOST SVD: W = up @ down;
Subspace Models: the token table T_fixed + T_S U^T and W = U W_small), as a LlamaForCausalLM (Qwen3ForCausalLM with
qk-norm), with the run's tokenizer. Before the folder is put in place, its logits on a check sequence are compared
with the logits the run's own layout computes; a model no standard architecture holds (CoLA, LaX, ResBM, MAPL,
lossy codecs) is refused with the reason, in one line, and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import torch

from nanotron_ext.cli_flags import InputFile, InputFolder, Int, OutputFolder, Parser

if TYPE_CHECKING:
    from nanotron_ext.inference.run import Folders

CHECK_TOKENS = 32


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Options every command that reads a run shares (export, generate, eval)."""
    parser.add_argument("--run", required=True, type=InputFolder(),
                        help="the run folder, general.output_dir/general.run (e.g. runs/tiny_llama)")
    parser.add_argument("--step", type=Int(0), default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--replica", type=Int(0), default=0, help="DP replica whose weights to read (default 0)")
    parser.add_argument("--checkpoints", default=None, type=InputFolder(), nargs="+", metavar="DIR",
                        help="checkpoint folder (default: checkpoints.dir of the run); with checkpoints.storage="
                        "per_host, every host's folder (or one the hosts' files were copied into)")
    parser.add_argument("--tokenizer", default=None, type=InputFile(format="tokenizer"),
                        help="tokenizer JSON (default: tokenizer.path of the run)")


def check_ids(vocab: int, length: int) -> torch.Tensor:
    """A fixed pseudo-random sequence [1, length] of token ids below `vocab`."""
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def export(run: str, out: str, step: Optional[int] = None, replica: int = 0, checkpoints: Folders = None,
           tokenizer: Optional[str] = None, overwrite: bool = False, verify: bool = True) -> Path:
    """Export (see the module doc); returns the folder. Raises UserFacingError with a one-line reason."""
    from nanotron_ext import __version__
    from nanotron_ext.config.loader import config_to_dict
    from nanotron_ext.errors import UserFacingError
    from nanotron_ext.hf.export import (
        EXPORT_INFO,
        check_out,
        commit,
        folder_logits,
        hf_model,
        require_transformers,
        write_folder,
    )
    from nanotron_ext.hf.names import architecture
    from nanotron_ext.hf.tokenizer import eos_id, hf_tokenizer
    from nanotron_ext.inference.run import gather, read_live

    target = Path(out).expanduser()
    check_out(target, overwrite)  # before any work
    require_transformers()

    def read(ckpt):  # type: ignore[no-untyped-def]  # (again with the newest if a live run prunes this one)
        tok_path = ckpt.tokenizer_path(tokenizer)
        cfg = ckpt.config.model
        ids = check_ids(min(cfg.vocab_size, ckpt.config.tokenizer.vocab_size), min(CHECK_TOKENS, cfg.max_seq_len))
        layout = ckpt.layout
        print(f"reading {ckpt.path} (step {ckpt.step}, dp={layout['dp']} tp={layout['tp']} pp={layout['pp']}; "
              f"replica {replica}) on {layout['tp'] * layout['pp']} process(es)", flush=True)
        return tok_path, ids, gather(ckpt, replica=replica, dense=True, check_ids=ids)

    ckpt, (tok_path, ids, got) = read_live(run, step, checkpoints, read)
    cfg, layout = ckpt.config.model, ckpt.layout
    if got.refusal is not None:
        raise UserFacingError(f"cannot export {ckpt.run_dir} as a standard transformers model: {got.refusal}; "
                              f"python -m nanotron_ext.generate / nanotron_ext.eval still read the run")
    model = hf_model(cfg, got.dense, eos_id(tok_path))
    info = {"run": str(ckpt.run_dir), "step": ckpt.step, "replica": replica, "layout": layout,
            "architecture": architecture(cfg), "model_config": config_to_dict(ckpt.config)["model"],
            "nanotron_ext_version": __version__, "exported_unix": time.time()}
    tmp = write_folder(target, model, hf_tokenizer(tok_path, cfg.max_seq_len), info)
    try:
        if verify:
            diff = (folder_logits(tmp, ids) - got.logits).abs().max().item()
            scale = max(1.0, got.logits.abs().max().item())
            print(f"check: {ids.shape[1]} tokens, max |logit difference| transformers vs the run's layout = {diff:.2e}")
            if not diff <= 1e-4 * scale:
                raise UserFacingError(f"the exported model's logits differ from the run's by {diff:.3g} (> "
                                      f"{1e-4 * scale:.3g}); nothing was written to --out")
            info["check"] = {"tokens": ids.shape[1], "max_abs_logit_diff": diff}
            (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        commit(tmp, target, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {architecture(cfg)} to {target}: load it with transformers.AutoModelForCausalLM.from_pretrained"
          f"({str(target)!r})")
    return target


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.errors import UserFacingError, one_line

    parser = Parser(prog="python -m nanotron_ext.export", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.add_argument("--out", required=True, type=OutputFolder(),
                        help="folder to write (refused when it exists, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export at --out (never a folder that export did not write)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip comparing the folder's logits with the run's before committing it")
    args = parser.parse_args(argv)
    try:
        export(args.run, args.out, args.step, args.replica, args.checkpoints, args.tokenizer,
               args.overwrite, args.verify)
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
