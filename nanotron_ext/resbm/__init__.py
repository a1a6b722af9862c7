"""ResBM: residual encoder/decoder bottlenecks at pipeline boundaries.

Paper: "ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism" (arXiv:2604.11947).
Selected by `model.codec.kind: resbm` with options under `model.codec.resbm` (h or ratio, m,
nonlinearity, norm placement, zero-init) and placed by `model.codec.boundaries` (stages = every
pipeline boundary; every_layer = after every block but the last, the paper's single-GPU convergence
setting; or a list). `technique` (technique.py: the section config.ResBMConfig, the "resbm" codec, the
rules on h and m) is this package's one registered object (the `nanotron_ext.techniques` entry point);
pieces.ResBMPieces builds the codec when a model is built. The core never imports this package.

Paper -> code:
- eq. 4-5, rectangular identity P^id (trunc when c > C, zero-pad when c < C): codec.trunc, codec.pad
  (eq. 6 is wrong for a narrower middle width: pad_d(trunc_h(x)) = x diag(1_h, 0); tests/test_resbm.py)
- sec. 3.2, bottleneck = autoencoder, each half linear-nonlinearity-linear: codec.TwoLayer
- sec. 3.2-3.3 / fig. C.1, encoder in the sender's FF residual function,
  b_l = trunc_h(x_attn_l) + E_l(FF(norm(x_attn_l))): codec.ResBMEncoder
- decoder in the receiver's attention branch, x_attn_{l+1} = pad_d(b_l) + Attn(norm(D_{l+1}(b_l))):
  codec.ResBMDecoder (returns (pad_d(b), D(b)) to the core's DecoderLayer)
- the same E and D on a residual stream sharded on d over TP (BOOST's btp; not in the paper): E's first
  linear row-parallel, D's last column-parallel, one narrow TP all-reduce each way: codec.ShardedResBMEncoder,
  codec.ShardedResBMDecoder (algebra in codec's docstring; tests/test_resbm_btp.py)
- sec. 3.4 / 4.1, optimisers (Muon on hidden matrices incl. E and D, RMS-matched so one peak lr serves
  AdamW and Muon, final lr 1% AdamW / 10% Muon): optimizer.muon_adjust_lr and
  optimizer.muon_min_lr_ratio in the core optimiser config; configs in reproduce/resbm/
- appendix A.3, parameter counts and bytes per boundary: reproduce/resbm/param_counts.py,
  tests/test_resbm.py (ledger bytes = mbs * seq * h * element_size per boundary per direction)
- appendix B.1 / table B.1 / fig. B.1, effective rank r_eff = sum(s^2) / max(s^2) and normalised
  spectra: analyse.effective_rank, analyse.normalised_spectrum, `python -m nanotron_ext.resbm.analyse`
- sec. 4.3 / table 3 / fig. A.2, throughput over slow links: nanotron_ext/bench/slow_link.py,
  reproduce/resbm/table3_throughput.py
"""
from nanotron_ext.resbm.technique import technique  # noqa: F401  (the entry point: light, no torch)
