"""A Llama-family model (RoPE, RMSNorm, SwiGLU, GQA, optional qk-norm, tied or untied embeddings)
laid out as nanotron PipelineBlocks, with a pluggable TP strategy and pipeline-boundary codec (the pieces
the config names, built by their techniques: nanotron_ext.models.pieces.ModelPieces).

Blocks and their stage: token_embedding (first stage) -> decoder.0 .. decoder.L-1 (split over
stages) -> lm_head and loss (last stage). Data enters as nanotron does it: `input_ids` exists on
the first stage and `label_ids` on the last; other ranks get TensorPointers.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.p2p import P2P
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotron.parallel.tensor_parallel.functional import sharded_cross_entropy
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder, pack_ids, unpack_ids, wire_dtype
from nanotron_ext.codecs.identity import IdentityDecoder, IdentityEncoder
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.constraints import Projections
from nanotron_ext.models.pieces import ModelPieces
from nanotron_ext.models.tp_strategy import tie_head_to_embedding
from nanotron_ext.parallel.layout import place_boundaries, split_layers

Maybe = Union[torch.Tensor, TensorPointer]


class DecoderLayer(nn.Module):
    """x_attn = residual + attn(hidden); out = x_attn + mlp(x_attn), with optional boundary codecs."""

    def __init__(
        self,
        attn: nn.Module,
        mlp: nn.Module,
        encoder: Optional[BoundaryEncoder] = None,
        decoder: Optional[BoundaryDecoder] = None,
        carry_ids: bool = False,
    ) -> None:
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.boundary_encoder, self.boundary_decoder = encoder, decoder
        self.carry_ids = carry_ids

    def forward(self, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:
        ids = inputs.get("input_ids")
        if self.boundary_decoder is not None:
            wire = inputs["wire"]
            if self.carry_ids:
                wire, ids = unpack_ids(wire)
            residual, hidden = self.boundary_decoder(wire, ids)
        else:
            residual = hidden = inputs["hidden_states"]
        x_attn = residual + self.attn(hidden)
        branch = self.mlp(x_attn)
        if self.boundary_encoder is not None:
            wire = self.boundary_encoder(residual=x_attn, branch=branch, input_ids=ids)
            # contiguous: nanotron's P2P sends a non-contiguous view's storage and the receiver hangs
            return {"wire": pack_ids(wire, ids) if self.carry_ids else wire.contiguous()}
        out = {"hidden_states": x_attn + branch}
        if self.carry_ids:
            out["input_ids"] = ids
        return out


class TokenEmbedding(nn.Module):
    def __init__(self, embedding: nn.Module, carry_ids: bool) -> None:
        super().__init__()
        self.embedding, self.carry_ids = embedding, carry_ids

    def forward(self, input_ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = {"hidden_states": self.embedding(input_ids)}
        if self.carry_ids:
            out["input_ids"] = input_ids
        return out


class ShardedLoss(nn.Module):
    """Mean token cross-entropy over vocab-sharded logits, in fp32: nanotron's sharded CE, or, at TP = 1 with
    model.compile, torch's cross-entropy, which build_model compiles with the decoder layers. Compiled, it reads the
    bf16 logits and writes their bf16 gradient without materialising fp32 logits, softmax and gradient: ~8 bytes of
    memory traffic per logit instead of nanotron's ~50 (fp32 copies, in-place exp, divide, gradient, cast back),
    i.e. ~18 GB instead of ~110 GB per step of the 125M GPU config (32k vocabulary, 64k tokens)."""

    def __init__(self, tp_pg: dist.ProcessGroup, compile: bool = False) -> None:
        super().__init__()
        self.tp_pg = tp_pg
        self.fused = compile and tp_pg.size() == 1

    def forward(self, sharded_logits: torch.Tensor, label_ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        if self.fused:
            return {"loss": F.cross_entropy(sharded_logits.float().flatten(0, 1), label_ids.flatten())}
        loss = sharded_cross_entropy(sharded_logits, label_ids.contiguous(), group=self.tp_pg, dtype=torch.float)
        return {"loss": loss.mean()}


class LlamaForTraining(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel_context: ParallelContext,
        p2p: P2P,
        layers_per_stage: Optional[List[int]] = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        tp_pg, pp = parallel_context.tp_pg, parallel_context.pp_pg.size()
        self.techniques = ModelPieces(cfg, tp_pg)  # this model's pieces; state they share lives there
        self.strategy = self.techniques.tp_strategy()
        self.codec: BoundaryCodec = self.techniques.codec(self.strategy)
        self.constraint = self.techniques.output_constraint(self.strategy)
        self.stage_of_layer = split_layers(cfg.num_layers, pp, layers_per_stage)
        sharded = self.strategy.residual_sharded
        where = place_boundaries(cfg.codec.boundaries, self.stage_of_layer, residual_sharded=sharded,
                                 codec_replicated=self.codec.wire_replicated(sharded),
                                 needs_token_ids=self.codec.needs_token_ids)
        self.codec_after = where.codec_after
        self.replicated_wires = where.replicated_wires
        """Stages whose outgoing pipeline wire is the same on every TP rank (AccountedP2P.scatter_gather)."""
        wire_after, carry = where.wire_after, where.carry_ids
        hidden_keys = {"hidden_states"} | ({"input_ids"} if carry else set())
        wire_keys = {"wire"}
        self._projections: Dict[int, Projections] = {}
        self.codec_encoders: Dict[int, BoundaryEncoder] = {}  # this rank's codec modules by boundary
        self.codec_decoders: Dict[int, BoundaryDecoder] = {}
        self._pp_pg = parallel_context.pp_pg
        self._p2p = p2p  # the codec's once-per-step exchanges travel the pipeline's own links

        self.token_embedding = PipelineBlock(
            p2p=p2p,
            module_builder=lambda: TokenEmbedding(self.techniques.embedding(self.strategy), carry),
            module_kwargs={},
            module_input_keys={"input_ids"},
            module_output_keys=hidden_keys,
        )
        self.decoder = nn.ModuleList()
        for i, stage in enumerate(self.stage_of_layer):
            starts, ends = (i - 1) in wire_after, i in wire_after
            self.decoder.append(
                PipelineBlock(
                    p2p=p2p,
                    module_builder=self._build_layer,
                    module_kwargs={"layer_idx": i, "stage": stage, "starts": starts, "ends": ends, "carry": carry},
                    module_input_keys=wire_keys if starts else hidden_keys,
                    module_output_keys=wire_keys if ends else hidden_keys,
                )
            )
        self.lm_head = PipelineBlock(
            p2p=p2p,
            module_builder=self.strategy.head,
            module_kwargs={},
            module_input_keys={"hidden_states"},
            module_output_keys={"sharded_logits"},
        )
        self.loss = PipelineBlock(
            p2p=p2p,
            module_builder=ShardedLoss,
            module_kwargs={"tp_pg": tp_pg, "compile": cfg.compile},
            module_input_keys={"sharded_logits", "label_ids"},
            module_output_keys={"loss"},
        )
        last = pp - 1
        self.token_embedding.build_and_set_rank(0)
        for block, stage in zip(self.decoder, self.stage_of_layer):
            block.build_and_set_rank(stage)
        self.lm_head.build_and_set_rank(last)
        self.loss.build_and_set_rank(last)
        if cfg.tie_embeddings:  # pp == 1 (validated), so both live on this rank
            tie_head_to_embedding(self.lm_head.pp_block, self.token_embedding.pp_block.embedding)

    def _build_layer(self, layer_idx: int, stage: int, starts: bool, ends: bool, carry: bool) -> DecoderLayer:
        """Boundaries are named by their sending layer: layer i encodes boundary i, layer i+1 decodes it."""
        attn, mlp = self.strategy.attention(layer_idx), self.strategy.mlp(layer_idx)
        if self.cfg.output_constraint.kind != "none":
            self._projections[layer_idx] = self.strategy.output_projections(attn, mlp)
        sent, received = layer_idx, layer_idx - 1
        encoder = decoder = None
        if ends:
            encoder = IdentityEncoder(wire_dtype(self.cfg))  # a plain stage boundary sends the compute dtype too
            if sent in self.codec_after:
                encoder = self.codec_encoders[sent] = self.codec.encoder(sent)
        if starts:
            decoder = IdentityDecoder()
            if received in self.codec_after:
                decoder = self.codec_decoders[received] = self.codec.decoder(received)
        return DecoderLayer(attn=attn, mlp=mlp, encoder=encoder, decoder=decoder, carry_ids=carry)

    def after_backward(self) -> None:
        """The step's gradients are complete on this rank: let the codec combine shared-parameter gradients."""
        self.codec.after_backward(self.codec_encoders, self.codec_decoders, self._p2p)

    @torch.no_grad()
    def apply_constraints(self) -> None:
        """Constrain this rank's output projections (model.output_constraint); build_model calls it after
        the weights are initialised, so a constraint sees (and may reparameterise) initialised weights."""
        for layer_idx, projections in self._projections.items():
            self.constraint.constrain(layer_idx, projections)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Re-establish per-layer constraints (model.output_constraint) on this rank's layers."""
        for layer_idx, projections in self._projections.items():
            self.constraint.after_step(layer_idx, projections)

    def sharded_logits(self, input_ids: Maybe) -> Maybe:
        """Vocab-sharded logits [b, s, V / tp] on the last stage (a TensorPointer elsewhere). Outside a pipeline
        engine (inference, nanotron_ext.inference) stages hand activations on directly, without gradients."""
        state = self.token_embedding(input_ids=input_ids)
        for layer in self.decoder:
            state = layer(**state)
        return self.lm_head(hidden_states=state["hidden_states"])["sharded_logits"]

    def forward(self, input_ids: Maybe, label_ids: Maybe) -> Dict[str, Maybe]:
        return self.loss(sharded_logits=self.sharded_logits(input_ids), label_ids=label_ids)
