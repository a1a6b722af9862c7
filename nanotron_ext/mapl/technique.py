"""MAPL's Technique: the `model.codec.mapl` and `optimizer.spel` sections, the "mapl" codec, the SPEL
optimiser group, and the rules on the codec's widths."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from nanotron_ext.config.checks import require
from nanotron_ext.mapl.config import MaplCodecConfig, SpelConfig
from nanotron_ext.technique import Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config, ModelConfig
    from nanotron_ext.metrics.tier_bytes import TierBytes

SPEL_TAG = "mapl_spel"


class MaplTechnique(Technique):
    name = "mapl"
    sections = {"model.codec.mapl": MaplCodecConfig, "optimizer.spel": SpelConfig}
    provides = {"model.codec.kind": ["mapl"], "optimizer group": [SPEL_TAG]}
    resume_free = ("optimizer.spel.lr_scale",)  # a step size, free across a resume like the core's optimizer.lr
    widths = ("model.codec.mapl.rank", "model.codec.mapl.anchor_width")
    pieces = "nanotron_ext.mapl.pieces:MaplPieces"

    def check_model(self, model: "ModelConfig") -> None:
        mapl, d = model.codec.mapl, model.hidden_size
        r, m = mapl.widths(d)
        require(mapl.rank is None or mapl.rank <= d, "model.codec.mapl.rank",
                f"{mapl.rank} exceeds model.hidden_size={d} (A_p must have orthonormal columns)")
        require(m <= d, "model.codec.mapl.anchor_width",
                f"{m} exceeds model.hidden_size={d} (the anchor basis P_p [m, d] has orthonormal rows)")
        require(not mapl.vq_groups or r % mapl.vq_groups == 0, "model.codec.mapl.vq_groups",
                f"{mapl.vq_groups} does not divide the wire width r={r}")

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """The wire of every token (Z and its id, or the RVQ indices; the gradient back) and the exchange that
        keeps the two sides' A_p and anchor table equal (mapl/closed_form.py)."""
        if key != "model.codec.kind":
            return None
        from nanotron_ext.mapl.closed_form import shared_sync, wire_per_token
        from nanotron_ext.metrics.tier_bytes import TierBytes, micro_batches, tokens_per_step

        n = tokens_per_step(cfg)
        fwd, bwd, form = wire_per_token(cfg)
        sync_fwd, sync_bwd, sync_form = shared_sync(cfg)
        return TierBytes(n * fwd + sync_fwd, n * bwd + sync_bwd,
                         f"{form} per token x {n} tokens ({micro_batches(cfg)} micro-batches); {sync_form}")


technique = MaplTechnique()
