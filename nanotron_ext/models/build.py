"""Build the configured model on this rank: TP strategy, codec, pipeline links, layout-independent init."""
from __future__ import annotations

from nanotron.parallel import ParallelContext

from nanotron_ext.config.schema import Config
from nanotron_ext.models.init import init_weights_
from nanotron_ext.models.llama import LlamaForTraining
from nanotron_ext.parallel.link import LinkEmulator
from nanotron_ext.parallel.p2p import AccountedP2P
from nanotron_ext.registry import REPLICA_CONFIGS, load_techniques


def build_model(cfg: Config, parallel_context: ParallelContext, link: LinkEmulator | None = None) -> LlamaForTraining:
    """The model for this rank's stage and TP shard, initialised from `general.seed` (or `model.init_from`)."""
    p2p = AccountedP2P(parallel_context.pp_pg, device=parallel_context.device, link=link)
    model = LlamaForTraining(cfg.model, parallel_context, p2p, cfg.parallelism.layers_per_stage)
    model.to(parallel_context.device)
    init_weights_(model, seed=cfg.general.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    imported = None
    if cfg.model.init_from is not None:  # before the constraints, which then see the imported weights
        from nanotron_ext.hf.importer import load_init_from_

        imported = load_init_from_(model, cfg.model)
    model.apply_constraints()
    if imported is not None:
        imported.report(model, cfg.model, parallel_context)
    if cfg.model.compile:
        for block in model.decoder:
            layer = getattr(block, "pp_block", None)  # only this stage's layers exist here
            if layer is not None:
                layer.compile()  # in place (nn.Module.compile): state_dict names stay as they are
    return model


def replica_config(cfg: Config, replica: int) -> Config:
    """The config DP replica `replica` builds its model from: the run's config unless the DP sync
    (parallelism.dp_sync) registered a per-replica override in REPLICA_CONFIGS (the core names no technique)."""
    load_techniques()
    if cfg.parallelism.dp_sync not in REPLICA_CONFIGS:
        return cfg
    return REPLICA_CONFIGS.get(cfg.parallelism.dp_sync)(cfg, replica)
