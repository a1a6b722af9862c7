"""BOOST's Technique: its config sections, the TP strategies it provides, and the rules between them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from nanotron_ext.boost.config import BoostConfig, LowRankConfig
from nanotron_ext.config.checks import require
from nanotron_ext.technique import Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config, ModelConfig
    from nanotron_ext.metrics.tier_bytes import TierBytes

LOW_RANK_STRATEGIES = ("vanilla", "btp")


class BoostTechnique(Technique):
    name = "boost"
    sections = {"model.low_rank": LowRankConfig, "model.boost": BoostConfig}
    provides = {"model.tp_strategy": LOW_RANK_STRATEGIES}
    widths = ("model.low_rank.rank",)  # r = d/4 in the paper
    shards_residual = ("btp",)  # BTP: each TP rank holds d/tp features of the residual stream
    no_output_projections = ("vanilla",)  # factor pairs, each Megatron-split: no one weight writes the stream
    memory_switches = ("model.boost.lowrank_checkpointing",)  # sec. 4.4: recompute inside chunks (low-rank models)
    pieces = "nanotron_ext.boost.pieces:BoostPieces"

    def resolve_model(self, model: "ModelConfig") -> None:
        if model.tp_strategy is None and model.low_rank.kind != "none":
            model.tp_strategy = "vanilla"  # Megatron TP of each factor pair: the documented default of a low-rank model

    def check_model(self, model: "ModelConfig") -> None:
        low = model.low_rank
        if low.kind == "none":
            require(model.tp_strategy not in LOW_RANK_STRATEGIES, "model.tp_strategy",
                    f"{model.tp_strategy!r} splits low-rank factor pairs, but model.low_rank.kind='none' (full-rank "
                    "models use 'megatron')")
            return
        require(model.tp_strategy != "megatron", "model.tp_strategy",
                f"'megatron' splits full-rank linears, but model.low_rank.kind={low.kind!r} factorises them: use "
                "'vanilla' (Megatron TP of each factor pair, the default for a low-rank model) or 'btp'")
        require(low.width(model.hidden_size) <= model.hidden_size, "model.low_rank.rank",
                f"{low.rank} exceeds model.hidden_size={model.hidden_size} (a bottleneck wider than the model "
                "compresses nothing)")

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """One TP rank's payload per step: Table 6 per block and pass x layers x micro-batches, forward and
        backward alike (each all-reduce's transpose is one of the same width)."""
        if key != "model.tp_strategy":
            return None
        from nanotron_ext.boost.comm_volume import kv_width, table6_tp_elements
        from nanotron_ext.metrics.tier_bytes import TierBytes, element_size, micro_batches

        m, t = cfg.model, cfg.tokens
        per_pass = m.num_layers * micro_batches(cfg) * element_size(m) * table6_tp_elements(
            name, t.micro_batch_size, t.sequence_length, m.hidden_size, m.ffn_size, m.low_rank.width(m.hidden_size),
            kv_width(m))
        form = {"btp": "7 b s r", "vanilla": "3 b s d + 2 b s kv + 2 b s d_ff"}[name]
        return TierBytes(per_pass, per_pass, f"BOOST Table 6: {form} per block and pass, x {m.num_layers} blocks x "
                         f"{micro_batches(cfg)} micro-batches; norm statistics, embedding and head left out")


technique = BoostTechnique()
