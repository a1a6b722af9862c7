"""`model.init_from: hf:DIR`: start a run of any layout from a transformers Llama (or Qwen3) folder.

nanotron_ext.models.build calls `load_init_from_` after the seeded init and before the model's constraints, so a
constraint sees the imported weights the way it sees initialised ones (Subspace Models: W_small = U^T W, or W
projected onto span(U)). Each rank reads only the tensors of its own stage, one at a time, and keeps its shard;
modules that implement nanotron_ext.models.dense.DenseEquivalent turn the dense weights into their own
parameters (BOOST's factor pairs: a rank-r truncated SVD; Subspace Models' split table: T_S = (E - T_fixed) U).
Parameters with no counterpart in a Llama (boundary codecs: ResBM, MAPL) keep their seeded init. The folder
(nanotron_ext.hf.importer.FolderTensors) is checked before anything is read (nanotron_ext.hf.folder.check_init_from).

After the constraints, `ImportedWeights.report` compares the model's dense equivalent with the folder's tensors
(relative Frobenius error per tensor, all stages) and prints it per layer on rank 0.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as torch_dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.hf.folder import check_init_from
from nanotron_ext.hf.importer import FolderTensors, format_report
from nanotron_ext.hf.names import split_fused
from nanotron_ext.models.dense import dense_state_dict, load_dense_state_dict_


class ImportedWeights:
    """What `load_init_from_` loaded on this rank; `report` (collective) prints how close the model came."""

    def __init__(self, folder: Path, tensors: FolderTensors, kept: List[str]) -> None:
        self.folder, self.tensors, self.kept = folder, tensors, kept

    def report(self, model: nn.Module, cfg: ModelConfig, ctx: ParallelContext) -> Dict[str, float]:
        """Relative error ||W_model - W_folder|| / ||W_folder|| of every imported tensor, all stages, known on
        every rank (0 = exact; a factorised linear shows its truncated-SVD loss, a Subspace Models projection
        the part of W outside span(U)); printed per layer on global rank 0. Collective over the world."""
        ours = split_fused(dense_state_dict(model, ctx.tp_pg, exact=False), cfg)
        errors = {}
        for name, value in ours.items():
            if name in self.tensors:
                ref = self.tensors[name].double()
                errors[name] = float((value.double() - ref).norm() / ref.norm().clamp_min(1e-30))
        merged: Dict[str, float] = {}
        kept: List[str] = []
        everyone = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(everyone, (errors, self.kept))
        for errs, k in everyone:
            merged.update(errs)
            kept += [n for n in k if n not in kept]
        if torch_dist.get_rank() == 0:
            print(format_report(merged, kept, self.folder), flush=True)
        return merged


@torch.no_grad()
def load_init_from_(model: nn.Module, cfg: ModelConfig) -> ImportedWeights:
    """Load `cfg.init_from` (hf:DIR) into this rank's stage, after checking the folder (the job checks it at start
    too, before any process group: nanotron_ext.train.__main__)."""
    check_init_from(cfg)
    folder = Path(cfg.init_from[3:]).expanduser()
    tensors = FolderTensors(folder)
    try:
        _, kept = load_dense_state_dict_(model, tensors)
    except KeyError as e:
        raise ConfigError(f"model.init_from: {folder} has no tensor for our parameter {e.args[0]}") from None
    return ImportedWeights(folder, tensors, kept)
