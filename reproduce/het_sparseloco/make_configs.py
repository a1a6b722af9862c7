"""Write the paper-scale SparseLoCo baseline configs (reproduce/het_sparseloco/sparseloco_<size>.yaml) of
"Heterogeneous Low-Bandwidth Pre-Training of LLMs" (Appendix A, Table 5 and the settings table).

    python reproduce/het_sparseloco/make_configs.py            # (re)write the YAML files next to this script
    python reproduce/het_sparseloco/make_configs.py --check    # exit 1 if a committed file differs

Stated by the paper: layers, hidden size, heads, context, batch tokens, steps, replicas M, AdamW
(0.9, 0.95), wd 0.1, inner lr 1e-3, clip 1.0, 500 warm-up steps, cosine; outer SGD lr 1.0, no momentum;
chunk 4096, k = 32, beta 0.95; H = 50 (5.8K / 116, 19.5K / 391 outer steps); "replicas partitioned across
4 pipeline stages" (sec. 3), so every replica is a pp = 4 pipeline (dp = M x pp = 4 GPUs; the compressed
replicas need those stage boundaries, a pp = 1 replica has none to compress). Our choices (not stated):
vocabulary 32000, untied embeddings, MHA, SwiGLU width (8/3 d rounded up to a multiple of 64 at 178M; at
512M and 1B that gives 438M and 941M, so the width there is chosen to match the paper's size: 5440 and
6144), cosine floor 10%, bf16 autocast, values sent in bf16, 1F1B with 4 micro-batches per replica step,
data = a local jsonl dump (DCLM is not shipped here). The paper gives the 1B hidden size three ways: Table 5
says 1536, the settings table 2048, and its 8 heads of dim 128 make 1024; we follow the settings table,
d = 2048 with 16 heads of 128.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Tuple

from nanotron_ext.bench.configs import write_or_check  # noqa: E402
from nanotron_ext.models.param_count import header_line  # noqa: E402

HERE = Path(__file__).resolve().parent
VOCAB = 32000
STAGES = 4  # pipeline stages per replica (sec. 3)
# size -> (layers, d, heads, FFN width, context, batch tokens, steps, replicas, paper size)
SIZES: Dict[str, Tuple[int, int, int, int, int, int, int, int, str]] = {
    "178m": (9, 1024, 8, 2752, 2048, 512 * 1024, 5800, 8, "178M"),
    "512m": (12, 1536, 12, 5440, 2048, 512 * 1024, 19500, 8, "512M"),
    "1b": (16, 2048, 16, 6144, 1024, 64 * 1024, 156500, 2, "1B"),
}
MICRO_BATCH = 8


def params(layers: int, d: int, ffn: int) -> int:
    """Closed form of the model's parameters (MHA, SwiGLU, two norms per block, final norm, untied head);
    tests compare it with the model built on the meta device."""
    return layers * (4 * d * d + 3 * d * ffn + 2 * d) + d + 2 * VOCAB * d


def config_text(size: str) -> str:
    layers, d, heads, ffn, ctx, batch, steps, m, paper = SIZES[size]
    per_replica = batch // ctx // m
    path = f"reproduce/het_sparseloco/sparseloco_{size}.yaml"
    half = ",".join(str(r) for r in range(m // 2, m))
    return "\n".join([
        f"# SparseLoCo baseline, {size}: M = {m} replicas, each a pipeline of {STAGES} stages ({m * STAGES} GPUs).",
        header_line(params(layers, d, ffn), True, paper),
        "# Written by reproduce/het_sparseloco/make_configs.py (edit that, not this file).",
        f"#   python -m nanotron_ext.data prepare --config-file {path}",
        f"#   torchrun --nnodes {m * STAGES // 8 or 1} --nproc_per_node={min(8, m * STAGES)} ... -m nanotron_ext.train "
        f"--config-file {path}",
        "# PP-Compress (all replicas, 87.5%): --set "
        f"'sparseloco.compressed_replicas=[{','.join(str(r) for r in range(m))}]' --set model.subspace.k={d // 8}",
        f"# Het-PP-Compress (half):            --set 'sparseloco.compressed_replicas=[{half}]' --set "
        f"model.subspace.k={d // 8}",
        "general:", f"  run: sparseloco_{size}", "  backend: auto",
        "parallelism:", f"  dp: {m}", "  tp: 1", f"  pp: {STAGES}", "  pp_engine: 1f1b", "  dp_sync: sparseloco",
        "model:", f"  vocab_size: {VOCAB}", f"  hidden_size: {d}", f"  ffn_size: {ffn}", f"  num_layers: {layers}",
        f"  num_heads: {heads}", f"  num_kv_heads: {heads}", f"  max_seq_len: {ctx}", "  tie_embeddings: false",
        "  dtype: bf16",
        "tokenizer:", "  path: data/dclm/tokenizer.json", f"  vocab_size: {VOCAB}",
        "tokens:", f"  sequence_length: {ctx}", f"  micro_batch_size: {MICRO_BATCH}",
        f"  batch_accumulation_per_replica: {per_replica // MICRO_BATCH}", f"  train_steps: {steps}",
        "  val_check_interval: 50", "  val_steps: 8",
        "optimizer:", "  name: adamw", "  lr: 1.0e-3", "  warmup_steps: 500", "  decay: cosine", "  min_lr_ratio: 0.1",
        "  weight_decay: 0.1", "  betas: [0.9, 0.95]", "  clip_grad: 1.0",
        "data:", "  source: jsonl", "  paths: [data/dclm/jsonl]", "  prepared_dir: data/dclm",
        "checkpoints:", f"  dir: checkpoints/het_sparseloco/{size}", "  interval: 500", "  keep_last: 2",
        "logging:", "  log_interval: 10", "  progress_bar: true",
        "sparseloco:", "  inner_steps: 50", "  chunk: 4096", "  topk: 32", "  beta: 0.95", "  quant_bits: 0",
        "  value_dtype: bf16", "  index_bits: 12", "  outer_lr: 1.0", "  outer_momentum: 0.0", "  aggregate: all", "",
    ])


def expected_files() -> Dict[Path, str]:
    return {HERE / f"sparseloco_{s}.yaml": config_text(s) for s in SIZES}


def main(argv: List[str] | None = None) -> int:
    return write_or_check(expected_files, argv, __doc__, "reproduce/het_sparseloco/make_configs.py")



if __name__ == "__main__":
    sys.exit(main())
