"""Build the configured model on this rank: TP strategy, codec, pipeline links, layout-independent init."""
from __future__ import annotations

from nanotron.parallel import ParallelContext

from nanotron_ext.config.schema import Config
from nanotron_ext.models.init import init_weights_
from nanotron_ext.models.llama import LlamaForTraining
from nanotron_ext.parallel.link import LinkEmulator
from nanotron_ext.parallel.p2p import AccountedP2P


def build_model(cfg: Config, parallel_context: ParallelContext, link: LinkEmulator | None = None) -> LlamaForTraining:
    """The model for this rank's stage and TP shard, initialised from `general.seed`."""
    p2p = AccountedP2P(parallel_context.pp_pg, device=parallel_context.device, link=link)
    model = LlamaForTraining(cfg.model, parallel_context, p2p, cfg.parallelism.layers_per_stage)
    model.to(parallel_context.device)
    init_weights_(model, seed=cfg.general.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    model.apply_constraints()
    return model
