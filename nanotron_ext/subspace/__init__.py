"""Subspace (Protocol) Models: exact compression of pipeline activations and activation gradients.

Paper: "Protocol Models: Scaling Decentralized Training with Communication-Efficient Model Parallelism"
(Ramasinghe et al., arXiv:2506.01260).
Selected by model.codec.kind = "subspace", which brings the split embedding (model.embedding.kind) and the
span(U) constraint (model.output_constraint.kind) it is exact with; options under model.subspace
(config.SubspaceConfig). `technique` (technique.py: the section, the names it provides, the one switch and
the rules) is this package's one registered object (the `nanotron_ext.techniques` entry point);
pieces.SubspacePieces builds the codec, embeddings, constraint and "subspace_adamw" optimiser for one
model and holds the hub they share. The core never imports this package.

Paper -> code (most equations were lost in the text; the reading follows the project's notes):
- sec. 4.3, shared subspace U (d x k, orthonormal, identical everywhere, never sent per step):
  basis.make_basis, basis.SubspaceHub (U a checkpointed buffer, one per model: pieces.SubspacePieces.hub,
  pieces.hub_of(model))
- sec. 4.3 eq. 7, projection matrices (attention output, MLP down) in span(U):
  constraints.SubspaceConstraint (parameterisation "projection": W <- U U^T W after init and every step;
  "reparam": W = U W_small, constraints.SubspaceRowLinear / reparameterise_)
- sec. 4.3.1, split token embedding TE = T_fixed + T_S U^T: basis.make_fixed_embedding, embedding.SplitEmbedding
- heterogeneous SparseLoCo's split table (T_S [V, d] trained, T_fixed adapted state; model.embedding.kind =
  subspace_adapted, set per replica by nanotron_ext.sparseloco.hetero): embedding.AdaptedSplitEmbedding
- sec. 4.3.1 eq. 8, forward compression Z = (X - T_fixed[ids]) U and reconstruction X = Z U^T + T_fixed[ids]:
  codec.SubspaceEncoder, codec.SubspaceDecoder (ids travel in the wire, codecs/base.pack_ids)
- sec. 4.4 eq. 9-10, backward compression G U / G U U^T: autograd through the codec's two products
- sec. 4.3-4.4 on a residual stream sharded over TP (BOOST's btp; not in the paper, derived per feature shard
  S_r): codec.SubspaceEncoder/Decoder (Z = sum_r (X - T_fixed[ids])_{S_r} U_{S_r}, one k-wide all-reduce),
  embedding.SplitEmbedding (X0_{S_r} = T_fixed[ids]_{S_r} + T_S[ids] U_{S_r}^T), constraints.project_ /
  SubspaceColumnLinear (btp's up factors, rows S_r: one k x in all-reduce, or W_{S_r} = U_{S_r} C);
  Grassmann updates and the sec. 5 AdamW refused there at tp > 1 (technique.SubspaceTechnique.check)
- sec. 4.5 eq. 11 and sec. 6, Grassmann updates (A = sum G^T G, Riemannian gradient, QR retraction):
  grassmann.grassmann_objective, riemannian_grad, retract, grassmann_step, grassmann_update, move_onto;
  A accumulated by codec.SubspaceDecoder; driven by SubspaceConstraint.after_step
- sec. 5 eq. 12-14, modified AdamW (second moment averaged to one scalar per input column of
  W [d, d_in]): optim.ColumnMeanAdamW, registered for tag optim.SUBSPACE_ADAMW_TAG
- sec. 4.1 / Fig. 1, 7 stable rank, and the energy a basis keeps: analyse (python -m nanotron_ext.subspace.analyse)
- Tables 1 and 3, Figs. 3 and 6 (scaled down), paper-scale configs: reproduce/sm/
"""
from nanotron_ext.subspace.technique import technique  # noqa: F401  (the entry point: light, no torch)
