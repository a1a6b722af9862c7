"""MAPL: learned per-boundary Stiefel projections for pipeline-parallel training over slow links.

Paper: "Learned Subspace Compression for Communication-Efficient Pipeline Parallelism" (MAPL,
arXiv:2606.05484; the text available to us is a summary; settings it leaves open are documented beside
the code and exposed in YAML: model.codec.mapl, optimizer.spel; config.py). `technique` (technique.py: the sections,
the "mapl" codec, the "mapl_spel" optimiser group, the rules on r and m) is this package's one registered
object (the `nanotron_ext.techniques` entry point); pieces.MaplPieces builds the codec and SPEL. The core
never imports this package.

Paper -> code:
- per-boundary projection A_p in St(d, r); sender Z = (X - anchor_p(ids)) A_p, receiver
  X = Z A_p^T + anchor_p(ids): codec.MaplEncoder, codec.MaplDecoder, codec.BoundaryProjection
- anchor embeddings anchor_p(ids) = E_small_p[ids] P_p (P_p fixed, orthonormal rows):
  codec.BoundaryProjection.anchor
- identical copies of A_p and E_small_p on both sides of a boundary: codec.MaplCodec.after_backward
  (gradients summed across the boundary, bytes counted as pp send:codec_grads)
- on a BTP-sharded residual stream (TP rank t holds features S_t): Z = sum_t (X - anchor)_{S_t} A_p[S_t] by one
  TP all-reduce of the r-wide Z, X'_{S_t} = Z A_p[S_t]^T + anchor_{S_t}; A_p, E_small_p replicated over TP with
  their gradients all-reduced there (an extension, not in the paper): codec.MaplEncoder, codec.MaplDecoder
  (`sharded_pg`), sync.sync_boundaries
- SPEL (Riemannian gradient g - A sym(A^T g), heavy-ball momentum, direction polar(m) by
  PolarExpress, retraction polar(A - alpha D)): spel.riemannian_gradient, spel.SPEL, spel.polar_factor;
  PolarExpress itself is a core optimiser utility: nanotron_ext.optim.polar_express
- hybrid optimiser (Muon on hidden matrices, AdamW on embeddings/head/norms, SPEL on projectors at
  0.1x lr): optimizer.name: muon with optimizer.spel.lr_scale (spel.build_spel)
"""
from nanotron_ext.mapl.technique import technique  # noqa: F401  (the entry point: light, no torch)
