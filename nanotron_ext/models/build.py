"""Build the configured model on this rank (TP strategy, codec, pipeline links, layout-independent init),
the config each DP replica builds it from, and the replica's DP sync."""
from __future__ import annotations

from nanotron.parallel import ParallelContext

from nanotron_ext.config.schema import Config
from nanotron_ext.models.init import init_weights_
from nanotron_ext.models.llama import LlamaForTraining
from nanotron_ext.parallel.data_parallel import DataParallelSync
from nanotron_ext.parallel.link import LinkEmulator
from nanotron_ext.parallel.p2p import AccountedP2P
from nanotron_ext.registry import DP_SYNCS


def build_model(cfg: Config, parallel_context: ParallelContext, link: LinkEmulator | None = None) -> LlamaForTraining:
    """The model for this rank's stage and TP shard, initialised from `general.seed` (or `model.init_from`)."""
    p2p = AccountedP2P(parallel_context.pp_pg, device=parallel_context.device, link=link)
    model = LlamaForTraining(cfg.model, parallel_context, p2p, cfg.parallelism.layers_per_stage)
    if cfg.parallelism.pp_scatter_gather:
        p2p.scatter_gather(parallel_context.tp_pg, model.replicated_wires)
    model.to(parallel_context.device)
    init_weights_(model, seed=cfg.general.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    imported = None
    if cfg.model.init_from is not None:  # before the constraints, which then see the imported weights
        from nanotron_ext.models.init_from import load_init_from_

        imported = load_init_from_(model, cfg.model)
    model.apply_constraints()
    if imported is not None:
        imported.report(model, cfg.model, parallel_context)
    if cfg.model.compile:
        loss = getattr(model.loss, "pp_block", None)  # the last stage's; fused cross-entropy at TP = 1 only
        for block in [*model.decoder, model.loss] if loss is not None and loss.fused else model.decoder:
            module = getattr(block, "pp_block", None)  # only this stage's layers exist here
            if module is not None:
                module.compile()  # in place (nn.Module.compile): state_dict names stay as they are
    return model


def replica_config(cfg: Config, replica: int) -> Config:
    """The config DP replica `replica` builds its model from: the run's config unless the technique that owns
    parallelism.dp_sync gives replicas their own (Technique.replica_config; the core names no technique)."""
    return DP_SYNCS.owner(cfg.parallelism.dp_sync).replica_config(cfg, replica)


def build_dp_sync(cfg: Config, model: LlamaForTraining, parallel_context: ParallelContext) -> DataParallelSync:
    """This rank's DP sync for `model` (parallelism.dp_sync; `cfg`: the replica's config)."""
    return model.techniques.dp_sync(cfg.parallelism.dp_sync, model, parallel_context, cfg)
