"""BOOST: bottleneck-aware tensor parallelism for low-rank Llamas.

Paper: "BOOST: Bottleneck-Optimized Scalable Training Framework for Low-Rank Large Language
Models" (arXiv:2512.12131). Configured by `model.low_rank.*` and `model.boost.*` (config.py); provides the
"vanilla" and "btp" TP layouts (`model.tp_strategy`; a low-rank model takes vanilla unless it names one).
`technique` (technique.py) is this package's one registered object (the `nanotron_ext.techniques` entry
point); pieces.BoostPieces builds the strategies when a model is built. The core never imports this package.

Paper -> code:
- sec. 3, low-rank linears (SVD y = A(Bx), CoLA y = A silu(Bx), LaX y_i = B_i(A_i x_i + A_{i-1} x_{i-1})):
  lowrank.linear_specs, lowrank.latent, lowrank.lax_previous, lowrank.LatentRelay
- the attention and SwiGLU sub-layers both TP schemes share (what differs: the linears' layout, the heads per
  rank, the chunk loop): sublayer.Attention, sublayer.MLP over sublayer.Sublayer
- sec. 3 / Fig. 3 top, vanilla low-rank TP (each factor pair a Megatron chunk):
  vanilla.VanillaAttention, vanilla.VanillaMLP, strategies.VanillaStrategy
- sec. 4.1 / Fig. 3 bottom, bottleneck-aware TP (chunk shifted to the r-wide latent):
  btp_sublayers.BTPAttention, btp_sublayers.BTPMLP, strategies.BTPStrategy,
  btp.ColumnParallelLinear / btp.RowParallelLinear (nanotron's TP linears, subclassed),
  btp.gather_features / split_features / reduce_scatter_features (residual sharded on d)
- sec. 4.2 / Algorithm 1, Online RMSNorm (statistic rides in the chunk's all-reduce):
  online_rmsnorm.ShardedRMSNorm, fold_statistic, unfold_statistic, rescale_local, rmsnorm_row_linear;
  btp.all_reduce_flat (one flat-buffer all-reduce per chunk)
- sec. 4.3 / Fig. 9, linear grouping: sublayer.shared_input_gemm (concatenated down GEMM),
  sublayer.distinct_input_gemm (batched up GEMM)
- sec. 4.4 / Fig. 5, comm-free low-rank activation checkpointing: lowrank.maybe_checkpoint, used by
  sublayer.Sublayer around the collective-free part of every chunk
- Table 6, communication volume per block: checked against the ledger in tests/test_boost.py
- Tables 3-5, Figures 6-8, Table 8: reproduce/boost/
"""
from nanotron_ext.boost.technique import technique  # noqa: F401  (the entry point: light, no torch)
