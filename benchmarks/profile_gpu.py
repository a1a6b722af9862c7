# One-off run, kept for reference only: made the torch.profiler tables in
# benchmarks/results/gpu/2026-11-27-h200/call2/profile/ on 1x H200 on 2026-11-27 (commit 32f5ebb); superseded by the profile stage of benchmarks/gpu_check.py. Not maintained, not linted.
# ruff: noqa
"""Where the GPU time goes: 125M (ours vs plain, flash+compile) and one BOOST LLaMA-1B block (CoLA btp vs full rank).
Run under torchrun --nproc_per_node 1 from the project root, PYTHONPATH=<root>:<site>:<root>/benchmarks. --tiny: CPU check."""
import argparse, sys, time, json
import torch
from torch.profiler import profile, ProfilerActivity

p = argparse.ArgumentParser(); p.add_argument("--tiny", action="store_true"); p.add_argument("--out", default="/tmp")
a = p.parse_args()
sys.path.insert(0, "benchmarks")
import plain_llama as pl
from nanotron_ext.bench import workload as bw
from nanotron_ext.config.loader import load_config
from nanotron_ext.bench.launch import init_distributed
from reproduce.boost import common as bc

cuda = torch.cuda.is_available() and not a.tiny
dev_act = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
res = {}

def sync():
    if cuda: torch.cuda.synchronize()

def timeit(fn, n):
    for _ in range(2): fn()
    sync(); t = time.perf_counter()
    for _ in range(n): fn()
    sync(); return (time.perf_counter() - t) / n

def prof(name, fn, n=2):
    with profile(activities=dev_act) as pr:
        for _ in range(n): fn()
        sync()
    tab = pr.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=70)
    print(f"\n==== {name}\n{tab}", flush=True)
    open(f"{a.out}/prof_{name}.txt", "w").write(tab)

tiny = ["model.hidden_size=64", "model.ffn_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "tokens.sequence_length=32", "model.max_seq_len=64", "tokens.micro_batch_size=2", "model.vocab_size=512",
        "tokenizer.vocab_size=512", "general.backend=gloo"] if a.tiny else ["general.backend=nccl"]
# --- A: 125M, flash + compile
cfg = load_config("examples/config_125m_gpu.yaml", tiny + ["model.compile=true"])
ctx = init_distributed(cfg)
ours = bw.build_trainee(cfg, ctx)
plain = pl.PlainLlama(cfg.model).to(ctx.device); plain.load_from(ours.model)
popt = pl.make_optimizer(plain, cfg.optimizer); plain.compile_blocks()
batches = [{k: v.to(ctx.device) for k, v in mb.items()} for mb in bw.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica)]
from torch.nn.attention import SDPBackend, sdpa_kernel
steps = {"ours": lambda: bw.train_iteration(ours, ctx, batches),
         "plain": lambda: pl.train_step(plain, popt, batches, cfg.optimizer.clip_grad, cfg.model.dtype == "bf16")}
with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]):
    for k, f in steps.items():
        for _ in range(3): f()
        res[f"125m_{k}_s"] = timeit(f, 3 if a.tiny else 8)
        print(f"125m {k}: {res[f'125m_{k}_s']*1e3:.1f} ms/iter", flush=True)
        prof(f"125m_{k}", f)
bw.release(ours, plain, popt); del ours, plain, popt, steps
# --- B: one BOOST LLaMA-1B block, bz=1, seq 4096: CoLA btp vs full rank
base = (["model.hidden_size=64", "model.ffn_size=128", "model.num_heads=4", "model.num_kv_heads=4", "tokens.sequence_length=32",
         "model.max_seq_len=64", "model.vocab_size=512", "tokenizer.vocab_size=512", "model.low_rank.rank=16", "general.backend=gloo"]
        if a.tiny else ["general.backend=nccl"]) + ["model.num_layers=1"]
for name, ov in {"boost1b_btp": ["model.tp_strategy=btp"], "boost1b_fullrank": bc.strategy_overrides("megatron", "cola")}.items():
    c = load_config("reproduce/boost/llama_1b_btp.yaml", base + ov)
    m = bw.build_trainee(c, ctx, with_optimizer=False).model
    blk = bw.first_local_block(m); x = bc.block_input(c, m, ctx, 1)
    def go():
        y = blk(hidden_states=x)["hidden_states"]; y.backward(torch.ones_like(y)); x.grad = None; blk.zero_grad(set_to_none=True)
    res[f"{name}_s"] = timeit(go, 3 if a.tiny else 10)
    print(f"{name}: block fwd+bwd {res[name+'_s']*1e3:.2f} ms; x {tuple(x.shape)} {x.dtype}; params "
          f"{sum(p.numel() for p in blk.parameters())/1e6:.1f}M dtype {next(blk.parameters()).dtype}", flush=True)
    prof(name, go)
    bw.release(m); del m, blk, x
json.dump(res, open(f"{a.out}/prof_times.json", "w"), indent=1)
print(json.dumps(res))
