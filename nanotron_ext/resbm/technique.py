"""ResBM's Technique: the `model.codec.resbm` section, the "resbm" codec, and the rules on its widths."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from nanotron_ext.config.checks import machine_memory_bytes, require
from nanotron_ext.resbm.config import ResBMConfig
from nanotron_ext.technique import Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config, ModelConfig
    from nanotron_ext.metrics.tier_bytes import TierBytes

# fp32 weight + gradient + AdamW's two moments: what one trained parameter costs before activations
BYTES_PER_TRAINED_PARAM = 16


class ResBMTechnique(Technique):
    name = "resbm"
    sections = {"model.codec.resbm": ResBMConfig}  # (its ratio resolves to 4 without h: ResBMConfig)
    provides = {"model.codec.kind": ["resbm"]}
    widths = ("model.codec.resbm.h", "model.codec.resbm.m")
    pieces = "nanotron_ext.resbm.pieces:ResBMPieces"

    def check_model(self, model: "ModelConfig") -> None:
        if model.codec.kind == "resbm":
            model.codec.resbm.width(model.hidden_size)  # h < d, named as model.codec.resbm.h

    def check(self, cfg: "Config") -> None:
        """The codec's parameters must fit the machine: m is free, and m = 1e8 would only fail at build time
        (out of memory) after the process groups are up."""
        model = cfg.model
        if model.codec.kind != "resbm":
            return
        rc = model.codec.resbm
        n_boundaries = len(cfg.codec_boundaries())
        params = rc.params_per_boundary(model.hidden_size) * n_boundaries
        need, have = params * BYTES_PER_TRAINED_PARAM, machine_memory_bytes()
        require(not have or need <= have, "model.codec.resbm.m",
                f"{rc.hidden(model.hidden_size)} gives the ResBM codec {params:,} parameters "
                f"({n_boundaries} boundaries x 2 m (d + h)), about {need / 2**30:.1f} GiB as fp32 weights, "
                f"gradients and AdamW state ({BYTES_PER_TRAINED_PARAM} bytes each), more than this machine's "
                f"{have / 2**30:.1f} GiB; lower it (default hidden_size // 4 = {model.hidden_size // 4})")

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """Only b (h wide) crosses, and its gradient back (sec. 3.2; appendix A.3 counts it in bf16)."""
        from nanotron_ext.metrics.tier_bytes import element_size, wire_bytes

        h, e = cfg.model.codec.resbm.width(cfg.model.hidden_size), element_size(cfg.model)
        return wire_bytes(cfg, h * e, h * e, f"h x {e} B (h = {h})")


technique = ResBMTechnique()
