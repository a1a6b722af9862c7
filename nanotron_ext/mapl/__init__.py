"""MAPL: learned per-boundary Stiefel projections for pipeline-parallel training over slow links.

Paper: "Learned Subspace Compression for Communication-Efficient Pipeline Parallelism" (MAPL,
arXiv:2606.05484; the text available to us is a summary; settings it leaves open are documented beside
the code and exposed in YAML: model.codec.mapl, optimizer.spel). Importing this package registers the
"mapl" codec and the "mapl_spel" optimiser group (loaded through the `nanotron_ext.techniques` entry
point, never by the core).

Paper -> code:
- per-boundary projection A_p in St(d, r); sender Z = (X - anchor_p(ids)) A_p, receiver
  X = Z A_p^T + anchor_p(ids): codec.MaplEncoder, codec.MaplDecoder, codec.BoundaryProjection
- anchor embeddings anchor_p(ids) = E_small_p[ids] P_p (P_p fixed, orthonormal rows):
  codec.BoundaryProjection.anchor
- identical copies of A_p and E_small_p on both sides of a boundary: codec.MaplCodec.after_backward
  (gradients summed across the boundary, bytes counted as pp send:codec_grads)
- SPEL (Riemannian gradient g - A sym(A^T g), heavy-ball momentum, direction polar(m) by
  PolarExpress, retraction polar(A - alpha D)): spel.riemannian_gradient, spel.SPEL, spel.polar_factor;
  PolarExpress itself is a core optimiser utility: nanotron_ext.optim.polar_express
- hybrid optimiser (Muon on hidden matrices, AdamW on embeddings/head/norms, SPEL on projectors at
  0.1x lr): optimizer.name: muon with optimizer.spel.lr_scale (spel.build_spel)
"""
from nanotron_ext.mapl import codec, spel  # noqa: F401  (register the "mapl" codec and the SPEL group)
