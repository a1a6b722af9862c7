"""SparseLoCo: low-communication data parallelism, the non-heterogeneous core of
"Heterogeneous Low-Bandwidth Pre-Training of LLMs". Selected by `parallelism.dp_sync: sparseloco` and
configured in the `sparseloco:` section (config.py). `technique` (technique.py: the section, the
"sparseloco" DP sync, per-replica configs, the rules across sections) is this package's one registered
object (the `nanotron_ext.techniques` entry point); pieces.SparseLoCoPieces builds the DP sync. The core
never imports this package.

Paper -> code:
- sec. 2 / Algorithm 1, inner loop: H = sparseloco.inner_steps steps of the run's optimiser (AdamW) per
  replica with no DP traffic: outer.SparseLoCoSync.after_backward (does nothing), after_step
- pseudo-gradient delta = theta_global - theta_local, error feedback e = beta e + delta, e -= transmitted:
  compress.compress_with_feedback_, driven by outer.SparseLoCoOuter.encode
- chunked top-k (64 x 64 tiles of 2-D tensors, k = 32; other and ragged tensors in equal zero-padded runs
  of <= 4096, so the density stays near k / 4096; per-tensor density reported, a warning above 2x):
  compress.chunk_spec, to_chunks / from_chunks, topk_indices, density_warning, outer.SparseLoCoOuter.report_density
- optional n-bit quantisation (public SparseLoCo code's 2-bit option): compress.quantize / dequantize
- compact indices (12 bits): codecs.bitpack.pack_stream / unpack_stream, the payload: compress.encode_payload /
  decode_payload, its size in closed form: payload_nbytes
- aggregation (mean over all replicas, or over the senders of each position) and outer SGD (lr 1.0,
  optional momentum): outer.SparseLoCoOuter.aggregate / apply; exchange: one all_gather in SparseLoCoSync.sync
- outer Nesterov momentum (DiLoCo, arXiv:2311.08105: lr 0.7, momentum 0.9; sparseloco.outer_nesterov; dense DiLoCo
  is top-k = chunk): outer.SparseLoCoOuter.apply, torch.optim.SGD's update
- streaming outer sync (not in the paper; "Streaming DiLoCo with overlapping communication", arXiv:2501.18512, one
  fragment; sparseloco.streaming.delay = tau, .alpha): the all_gather on a side thread over a copy of the DP group
  (streaming.side_dp_group, InFlightGather) behind the next tau inner steps, then the outer step and the merge
  alpha * local + (1 - alpha) * global (streaming.merge_): streaming.StreamingSparseLoCoSync (send / arrive; the
  in-flight payloads in its checkpoint state), in the simulated driver SimulatedReplicas.send / arrive
- simulated replicas (M replicas in one process, same math): simulate.SimulatedReplicas; a whole run of
  M replicas with the trainer's inner step: simulate.run_simulated (sweeps: reproduce/het_sparseloco/sim_sweep.py)
- communication accounting and compute utilisation over a bandwidth (figs. 2, 3b): accounting
- sec. 2.3 heterogeneous replicas (sparseloco.compressed_replicas: those replicas run the subspace codec,
  the others uncompressed): technique.SparseLoCoTechnique.replica_config (Subspace's keys set by
  subspace.technique.heterogeneous_replica), applied by the core's models.build.replica_config in both drivers
- sec. 2.4 embedding adaptation (T_S = T U U^T, T_fixed = T - T U U^T; after every sync fold
  T_S - T_S U U^T into T_fixed, applied to the global copy of T_S too, only on the rows the outer step
  changed): hetero.split_, hetero.fold_step, run by hetero.HeteroHook (an outer.ReplicaHook) in both
  drivers; the fold reaches a compressed pipeline's later stages as the step's nonzero entries
  (hetero.fold_nbytes). Table 4 switches sparseloco.embedding_adaptation / weight_projection /
  modified_adamw (mapped onto model.subspace); Grassmann (sparseloco.grassmann_every) updates one U shared by
  all replicas at outer syncs.
  Tables: reproduce/het_sparseloco/README.md
- replicas that leave and rejoin (not in the paper; the setting it targets): sparseloco.fault_tolerance, the outer
  loop on torchft's quorum, reconfigurable process groups and live recovery: fault.FaultTolerantSparseLoCoSync;
  a lighthouse and one job per replica on one machine, restarted when they die: ft_launch
"""
from nanotron_ext.sparseloco.technique import technique  # noqa: F401  (the entry point: light, no torch)
