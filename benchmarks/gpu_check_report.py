"""The report of benchmarks/gpu_check.py: the CUDA-vs-CPU comparison, stage verdicts, one JSON, one markdown
page and one PNG (bench.report writes them atomically; the figure's title names the device and the date)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import gpu_check_figure
import gpu_check_memory

from nanotron_ext.bench import report as br
from nanotron_ext.cli_checks import Writer, output_files

MIB = 2**20
# --out's (and --copy-to's) gpu_check.json, .md and .png replace only files the GPU check wrote (cli_checks.Writer)
GPU_CHECK = Writer("benchmarks/gpu_check.py", "the GPU check", legacy_keys=("meta", "stages"))


# ------------------------------------------------------------------------------------------------
# the CUDA-vs-CPU check
# ------------------------------------------------------------------------------------------------
def _worst_rel(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare_halves(device_rows: Sequence[Mapping[str, Any]], cpu_rows: Sequence[Mapping[str, Any]],
                   tolerance: Mapping[str, float],
                   pinned_rows: Sequence[Mapping[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Per technique: worst relative loss difference over the steps against the tolerance, and whether ledger
    bytes, codec wire bytes and SparseLoCo payload bytes are identical. The tolerance is the dtype's unless the
    row's "check" (gpu_check.DISCRETE_CHECKS) sets its own: `tolerance` for every step, `first_tolerance` for step 1;
    a technique with a pinned CPU run (its device code assignments replayed) is judged against that run, whose code
    disagreement must stay under `max_code_disagreement`, and the unpinned difference is kept for information."""
    cpu = {r["name"]: r for r in cpu_rows}
    pinned = {r["name"]: r for r in pinned_rows}
    out = []
    for d in device_rows:
        check = d.get("check") or {}
        c = cpu.get(d["name"], {"status": "missing"})
        ref = pinned.get(d["name"], {"status": "missing"}) if check.get("max_code_disagreement") else c
        row: Dict[str, Any] = {"name": d["name"], "device_status": d["status"], "cpu_status": ref["status"]}
        if d["status"] != "ok" or ref["status"] != "ok":
            row["verdict"] = "not compared"
            out.append(row)
            continue
        tol = check.get("tolerance", tolerance[d["dtype"]])
        same_len = len(d["losses"]) == len(ref["losses"]) > 0
        worst = _worst_rel(d["losses"], ref["losses"]) if same_len else float("inf")
        first = _worst_rel(d["losses"][:1], ref["losses"][:1]) if same_len else float("inf")
        drop = ref["losses"][0] - ref["losses"][-1] if same_len else 0.0
        bytes_same = all(d.get(k) == c.get(k) for k in ("comm_bytes", "wire_bytes_per_step", "sync_bytes"))
        row.update(dtype=d["dtype"], tolerance=tol, worst_rel=worst, first_rel=first,
                   loss_device=d["losses"][-1],
                   loss_cpu=ref["losses"][-1], drop=drop,
                   drop_in_tol=drop / (tol * abs(ref["losses"][0])) if same_len else 0,
                   bytes_identical=bytes_same, misplaced=d.get("misplaced", []),
                   wire_bytes_per_step=d.get("wire_bytes_per_step"), sync_bytes=d.get("sync_bytes"),
                   peak_memory_bytes=d.get("peak_memory_bytes"))
        ok = same_len and worst <= tol and bytes_same and not row["misplaced"]
        if "first_tolerance" in check:
            row["first_tolerance"] = check["first_tolerance"]
            ok = ok and first <= check["first_tolerance"]
        if ref is not c:
            row["pinned"] = True
            row["code_disagreement"] = ref.get("code_disagreement")
            row["max_code_disagreement"] = check["max_code_disagreement"]
            if c.get("status") == "ok" and len(c["losses"]) == len(d["losses"]):
                row["unpinned_worst_rel"] = _worst_rel(d["losses"], c["losses"])
            ok = (ok and row["code_disagreement"] is not None
                  and row["code_disagreement"] <= check["max_code_disagreement"])
        row["verdict"] = "pass" if ok else "FAIL"
        out.append(row)
    by = {r["name"]: r for r in cpu_rows if r.get("status") == "ok"}
    if "bf16_autocast" in by and "full_rank" in by:  # for scale: what bf16 alone changes on the CPU
        for row in out:
            if row["name"] == "bf16_autocast":
                row["cpu_bf16_vs_fp32_rel"] = _worst_rel(by["bf16_autocast"]["losses"], by["full_rank"]["losses"])
    return out


def stage_status(stage: str, body: Mapping[str, Any]) -> str:
    """ok: everything ran and every check held; partial: something was skipped (time budget); failed:
    an error or a failed check."""
    if "error" in body:
        return "failed"
    if stage == "techniques":
        rows = [r for half in body["rows"].values() for r in half]
        verdicts = [r["verdict"] for r in body["comparison"]]
    elif stage == "boost":
        rows = []
        verdicts = ["FAIL" if "failed" in n else "skipped" for n in body.get("notes", [])]
    else:  # memory: a config the planner or the allocator did not give a figure for is a partial stage
        rows, verdicts = list(body["rows"]), [c["verdict"] for c in body.get("comparison", [])]
    if stage != "boost" and not rows:
        return "skipped"
    if any(r["status"] == "failed" for r in rows) or "FAIL" in verdicts:
        return "failed"
    if any(r["status"] == "skipped" for r in rows) or "skipped" in verdicts or "not compared" in verdicts:
        return "partial"
    return "ok"


# ------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------
def _f(v: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _mib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / MIB:,.0f}"


def _techniques_md(body: Mapping[str, Any]) -> List[str]:
    tol = body["tolerance"]
    lines = ["## Every technique on the device vs CPU/gloo", "",
             f"{body['steps']} training steps each at world size 1; loss after every step compared (worst relative "
             f"difference; tolerance fp32 {tol['fp32']:g}, bf16 {tol['bf16']:g}; why: benchmarks/gpu_check.py). "
             "'drop / tol' is the loss decrease over the run in units of the tolerance: how far a wrong result could "
             "move and still be caught. Bytes: ledger bytes per step, codec wire bytes per step, "
             "SparseLoCo payloads.", ""]
    headers = ["technique", "precision", "loss (device)", "loss (CPU)", "step-1 rel diff", "worst rel diff",
               "tol", "drop / tol",
               "bytes identical", "wire B/step", "peak MiB", "off-device", "verdict"]
    body_rows = []
    for r in body["comparison"]:
        if r["verdict"] == "not compared":
            body_rows.append([r["name"], "-", r["device_status"], r["cpu_status"], "-", "-", "-", "-", "-", "-", "-",
                              "-", "not compared"])
            continue
        name = r["name"] + (" (CPU run with the device's codes)" if r.get("pinned") else "")
        tol = f"{r['tolerance']:g}" + (f" (step 1: {r['first_tolerance']:g})" if "first_tolerance" in r else "")
        body_rows.append([name, r["dtype"], _f(r["loss_device"]), _f(r["loss_cpu"]), f"{r['first_rel']:.1e}",
                          f"{r['worst_rel']:.1e}",
                          tol, f"{r['drop_in_tol']:.0f}", "yes" if r["bytes_identical"] else "NO",
                          r["wire_bytes_per_step"] or "-", _mib(r["peak_memory_bytes"]),
                          ", ".join(r["misplaced"]) or "none", r["verdict"]])
    lines.append(br.markdown_table(headers, body_rows))
    for r in body["comparison"]:
        if r.get("pinned"):
            lines += ["", f"{r['name']}: compared with a CPU run that replays the device's RVQ code assignments "
                          f"(benchmarks/gpu_check.py, DISCRETE_CHECKS); that run's own argmin would have changed "
                          f"{_f(r.get('code_disagreement'), '{:.1e}')} of them (limit {r['max_code_disagreement']:g}). "
                          f"Without pinning, device vs CPU: {_f(r.get('unpinned_worst_rel'), '{:.1e}')} (amplified "
                          "last-bit noise: benchmarks/results/discrete_codec_sensitivity.md)."]
    scale = [r for r in body["comparison"] if "cpu_bf16_vs_fp32_rel" in r]
    if scale:
        lines += ["", "For scale: on the CPU, bf16 autocast alone moves the loss by "
                      f"{scale[0]['cpu_bf16_vs_fp32_rel']:.1e} (worst relative, bf16_autocast vs full_rank)."]
    lines += _problems([r for half in body["rows"].values() for r in half])
    return lines


def _problems(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    bad = [r for r in rows if r.get("status") in ("failed", "skipped")]
    if not bad:
        return []
    return ["", "Not run or failed:", ""] + [f"- {r['name']}: {r['status']}: {r.get('error') or r.get('note', '')}"
                                            for r in bad]


def _throughput_md(body: Mapping[str, Any], size: str = "125M") -> List[str]:
    t = body["targets"]
    paths = sorted({r["step_guard"] for r in body["rows"] if r.get("step_guard")})
    lines = [f"## {size} throughput: nanotron_ext vs a plain-PyTorch loop of the same shape", "",
             f"{body['config']} with random tokens, iterations of the two interleaved, median of the timed iterations "
             f"(first ones dropped). Targets (issue 40): ours / plain >= {t['ratio']}, MFU >= {t['mfu']:.0%} with "
             "compile in bf16 on an H100/H200 (judged on each compiled setting). Both get the same public torch "
             "features: attention backend, compile (blocks and loss), AdamW implementation (column 'AdamW'). Ours "
             "takes the trainer's step (Replica and its step guard). First "
             "loss: both models on the first batch before any step (same weights: they must agree).", ""]
    lines += [f"Ours ran: {p}" for p in paths] + ([""] if paths else [])
    headers = ["setting", "attention", "AdamW (ours / plain)", "ours tok/s", "plain tok/s", "ours / plain", "MFU ours",
               "MFU plain", "1st iter s (ours/plain)", "peak MiB (ours/plain)", "first loss (ours/plain)", "targets"]
    rows = []
    # every setting starts from the same weights and batch: an attention kernel that computes something else (e.g.
    # mishandles grouped KV heads) shows as a first loss unlike the first setting's, on both sides alike
    ok = [r for r in body["rows"] if r["status"] == "ok"]
    reference = ok[0]["first_loss"]["plain"] if ok else None
    for r in body["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"]] + ["-"] * 10 + [f"{r['status']}: {r.get('error') or r.get('note')}"])
            continue
        o, p = r["models"]["nanotron_ext"], r["models"]["plain"]
        target = "-"
        if abs(r["first_loss"]["plain"] - reference) > 1e-2 * abs(reference):
            target = f"invalid: first loss differs from {ok[0]['name']}'s"
        elif r.get("compile") and o["mfu"] is not None:
            target = "met" if r["ratio"] >= t["ratio"] and o["mfu"] >= t["mfu"] else "NOT met"
        opts = r.get("optimizers", {})
        rows.append([r["name"], r.get("attention") or ("flash" if r.get("flash") else "torch's pick"),
                     f"{opts.get('nanotron_ext', '-')} / {opts.get('plain', '-')}",
                     f"{o['tokens_per_s']:,.0f}", f"{p['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
                     _f(o["mfu"], "{:.1%}"), _f(p["mfu"], "{:.1%}"),
                     f"{o['first_iteration_s']:.1f} / {p['first_iteration_s']:.1f}",
                     f"{_mib(o['peak_memory_bytes'])} / {_mib(p['peak_memory_bytes'])}",
                     f"{r['first_loss']['nanotron_ext']:.4f} / {r['first_loss']['plain']:.4f}", target])
    return lines + [br.markdown_table(headers, rows)]


def _profile_md(body: Mapping[str, Any]) -> List[str]:
    lines = ["## Where a training iteration's time goes (torch.profiler)", ""]
    for r in body["rows"]:
        if r["status"] != "ok":
            lines.append(f"- {r['name']}: {r['status']}: {r.get('error') or r.get('note')}")
            continue
        models = r["models"]
        clock = next(iter(models.values()))["clock"]
        lines += [f"Setting {r['setting']}, {r['iterations']} iterations each, self {clock} time per iteration "
                  f"(AdamW: {r['optimizers'].get('nanotron_ext')} / {r['optimizers'].get('plain')}). Wall: "
                  + ", ".join(f"{m} {v['wall_ms']:.1f} ms" for m, v in models.items())
                  + f"; busy {clock}: " + ", ".join(f"{m} {v['busy_ms']:.1f} ms" for m, v in models.items()) + ".", ""]
        kinds = list(dict.fromkeys(k for v in models.values() for k in v["kinds_ms"]))
        ms = {m: v["kinds_ms"] for m, v in models.items()}
        lines += [br.markdown_table(["kind of work"] + [f"{m} ms" for m in models] + ["ours - plain ms"],
                                    [[k] + [f"{ms[m].get(k, 0.0):.2f}" for m in models]
                                     + [f"{ms['nanotron_ext'].get(k, 0.0) - ms['plain'].get(k, 0.0):+.2f}"]
                                     for k in kinds]), ""]
        for m, v in models.items():
            lines += [f"Top {len(v['top'])} of {m}:", "",
                      br.markdown_table(["kernel" if clock == "device" else "op", "kind", "calls / iter", "ms / iter"],
                                        [[x["name"][:90].replace("|", "/"), x["kind"], x["calls"], f"{x['ms']:.2f}"]
                                         for x in v["top"]]), ""]
    return lines


def _codecs_md(body: Mapping[str, Any]) -> List[str]:
    lines = ["## Codec overhead per token (one boundary, throughput shape)", ""]
    headers = ["codec", "encode ns/token", "decode ns/token", "enc+dec fwd+bwd ns/token", "wire B/token", "wire dtype",
               "vs fp32 hidden", "off-device"]
    rows = []
    for r in body["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"], "-", "-", "-", "-", "-", "-", f"{r['status']}: {r.get('error') or r.get('note')}"])
            continue
        rows.append([r["name"], f"{r['encode_ns_per_token']:.1f}", f"{r['decode_ns_per_token']:.1f}",
                     f"{r['fwd_bwd_ns_per_token']:.1f}", f"{r['wire_bytes_per_token']:.1f}", r["wire_dtype"],
                     f"{r['hidden_bytes_per_token'] / r['wire_bytes_per_token']:.1f}x smaller",
                     ", ".join(r["misplaced"]) or "none"])
    return lines + [br.markdown_table(headers, rows)]


def _fig7_md(name: str, res: Mapping[str, Any], peak_tflops: Optional[float]) -> List[str]:
    meta = res["meta"]
    mb = meta.get("micro_batch")
    lines = [f"### {name}: BOOST Figure 7, per-linear forward GEMMs ({meta.get('machine')}, micro-batch {mb})", ""]
    headers = ["design", "linear", "GFLOP", "ms", "TFLOP/s", "util (best GEMM)", "util (datasheet)", "time / vanilla"]
    rows = []
    for r in res["rows"]:
        if r["micro_batch"] != mb:
            continue
        ds = r["flops_per_s"] / (peak_tflops * 1e12) if peak_tflops else None
        rows.append([r["design"], r["linear"], f"{r['flops'] / 1e9:.2f}", f"{r['seconds'] * 1e3:.3f}",
                     f"{r['flops_per_s'] / 1e12:.1f}", f"{r['utilisation']:.0%}", _f(ds, "{:.0%}"),
                     br.fmt_x(r.get("seconds_vs_vanilla"))])
    return lines + [br.markdown_table(headers, rows)] + _verdicts(res)


def _table3_md(res: Mapping[str, Any]) -> List[str]:
    lines = [f"### BOOST Table 3: grouped vs ungrouped linears under BTP ({res['meta'].get('machine')})", ""]
    headers = ["bz", "part", "ungrouped ms", "grouped ms", "speedup", "paper"]
    rows = [[r["micro_batch"], r["part"], f"{r['total_ungrouped_s'] * 1e3:.3f}", f"{r['total_grouped_s'] * 1e3:.3f}",
             f"{r['speedup']:.2f}x +- {r['speedup_err']:.2f}", br.fmt_x(r.get("paper_speedup"))] for r in res["rows"]]
    return lines + [br.markdown_table(headers, rows)] + _verdicts(res)


def _verdicts(res: Mapping[str, Any]) -> List[str]:
    claims = res.get("paper") or []
    if not claims:
        return []
    def verdict(c: Mapping[str, Any]) -> str:
        if c.get("measured") is None:  # e.g. a collective's time at TP=1, where there is no collective
            return "not measured here"
        return "within noise" if c.get("within_noise") else ("held" if c.get("held") else "NOT held")

    rows = [[c["name"], c["source"], _f(c.get("paper"), "{:.2f}"), _f(c.get("measured"), "{:.2f}"), c["claimed"],
             verdict(c)] for c in claims]
    return ["", br.markdown_table(["paper claim", "source", "paper", "ours", "claimed", "on our numbers"], rows)]


def _boost_md(body: Mapping[str, Any], peak: Optional[float]) -> List[str]:
    lines = ["## BOOST's single-GPU parts (reproduce/boost scripts, one rank)", "",
             "LLaMA-1B of Table 8 (its Table 8 layout is one GPU, so these are its shard shapes), one decoder layer "
             "built; 'util (datasheet)' divides by the GPU's dense bf16 peak; '7B layer' is one unsharded LLaMA-7B "
             "layer (Table 8 runs 7B at TP=4: its shards are 4x smaller).", ""]
    if "fig7" in body:
        lines += _fig7_md("1B", body["fig7"], peak) + [""]
    if "table3" in body:
        lines += _table3_md(body["table3"]) + [""]
    if "fig7_7b_layer" in body:
        lines += _fig7_md("7B layer", body["fig7_7b_layer"], peak) + [""]
    return lines + [f"- {n}" for n in body.get("notes", [])]


def markdown(result: Mapping[str, Any]) -> str:
    meta, stages = result["meta"], result["stages"]
    peak = None
    if "throughput" in stages:
        peak = next((r.get("peak_tflops") for r in stages["throughput"].get("rows", []) if r.get("peak_tflops")), None)
    head = ["# GPU check" + (" (CPU dry run: tiny shapes, timings meaningless)" if meta.get("dry_run") else ""), "",
            f"{meta.get('gpu') or meta.get('machine')}, driver {meta.get('driver', '-')}, torch {meta.get('torch')} "
            f"(CUDA {meta.get('cuda') or '-'}, NCCL {meta.get('nccl', '-')}), nanotron {meta.get('nanotron', '-')}, "
            f"commit {meta.get('commit') or '-'}, {meta.get('date')}", "",
            "Made by `make gpu-check` (benchmarks/gpu_check.py, whose docstring says what each number means).", "",
            br.markdown_table(["stage", "status", "measured on", "date", "seconds (budget)"],
                              [[s, b.get("status"), b["meta"].get("gpu") or b["meta"].get("machine"),
                                b["meta"].get("date"),
                                f"{b['meta'].get('seconds')} ({b['meta'].get('budget_s'):.0f})"] for s,
                               b in stages.items()])]
    parts = [head]
    sections = (("techniques", _techniques_md), ("throughput", _throughput_md), ("profile", _profile_md),
                ("throughput_1b", lambda b: _throughput_md(b, "1B")),
                ("memory", lambda b: gpu_check_memory.memory_md(b, br.markdown_table)), ("codecs", _codecs_md))
    for name, fn in sections:
        if name in stages:
            parts.append([""] + (fn(stages[name]) if "error" not in stages[name] else
                                 [f"## {name}", "", f"failed: {stages[name]['error']}"]))
    if "boost" in stages:
        b = stages["boost"]
        parts.append([""] + (_boost_md(b, peak) if "error" not in b else ["## boost", "", f"failed: {b['error']}"]))
    return "\n".join(line for part in parts for line in part) + "\n"


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------
def _slim(result: Mapping[str, Any]) -> Dict[str, Any]:
    """The result without bulky per-iteration lists the sub-scripts keep in their meta."""
    out = json.loads(json.dumps(result, default=str))
    for res in out.get("stages", {}).get("boost", {}).values():
        if isinstance(res, dict):
            res.get("meta", {}).pop("raw", None)
    return out


def write(result: Mapping[str, Any], out: Path) -> List[Path]:
    """gpu_check.json, gpu_check.md and gpu_check.png in `out` (each written atomically)."""
    result = _slim(result)
    written = [GPU_CHECK.write_json(out / "gpu_check.json", result, indent=1),
               GPU_CHECK.write_markdown(out / "gpu_check.md", markdown(result))]
    title = "GPU check" + (" (CPU dry run)" if result["meta"].get("dry_run") else "")
    written.append(br.save_figure(gpu_check_figure.figure(result), out / "gpu_check.png", title, result["meta"],
                                  GPU_CHECK))
    return written


def check_out(flag: str, folder: Path) -> List[Path]:
    """The files `write` puts in `folder`, checked before any stage runs (the rule of cli_checks.Writer)."""
    return output_files(flag, folder / "gpu_check.json", GPU_CHECK, [folder / "gpu_check.md", folder / "gpu_check.png"])


def summary_text(result: Mapping[str, Any]) -> str:
    lines = ["", "== gpu check =="]
    for stage, body in result["stages"].items():
        lines.append(f"{stage:<13} {body.get('status')}")
        if stage == "techniques" and "comparison" in body:
            bad = [r["name"] for r in body["comparison"] if r["verdict"] != "pass"]
            lines.append(f"            {len(body['comparison']) - len(bad)} of {len(body['comparison'])} techniques "
                         f"agree with CPU" + (f"; not: {', '.join(bad)}" if bad else ""))
        if stage == "memory":
            for c in body.get("comparison", []):
                ratio = "" if c.get("ratio") is None else f"planned / measured {c['ratio']:.3f}  "
                lines.append(f"            {c['name']:<5} {c.get('phase', ''):<9} {ratio}{c['verdict']}")
        if stage in ("throughput", "throughput_1b"):
            for r in body.get("rows", []):
                if r["status"] == "ok":
                    o = r["models"]["nanotron_ext"]
                    lines.append(f"            {r['name']:<14} ours/plain {r['ratio']:.3f}  ours "
                                 f"{o['tokens_per_s']:,.0f} tok/s" + (f"  MFU {o['mfu']:.1%}" if o["mfu"] else ""))
    return "\n".join(lines)
