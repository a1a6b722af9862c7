"""torchrun --nproc_per_node=N -m nanotron_ext.train --config-file X.yaml [--set key=value ...]"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.config.loader import add_config_args, config_from_args
    from nanotron_ext.errors import UserFacingError

    parser = argparse.ArgumentParser(prog="python -m nanotron_ext.train", description=__doc__)
    add_config_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        from nanotron_ext.train.trainer import Trainer

        trainer = Trainer(cfg, config_file=args.config_file)
        trainer.train()
    except UserFacingError as e:
        # Every rank raises the same error; one line from rank 0 is enough, before torchrun's banner.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
