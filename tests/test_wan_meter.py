"""The WAN meter (nanotron_ext/bench/wan/): reading runs, time to target, pooling seeds, the dry run and the
three-tier slot; the arithmetic against numbers worked out by hand."""
from __future__ import annotations

import pytest

from nanotron_ext.bench.wan import cli, presets, results, runs, systems


def _records(step_times, val_at):
    """metrics.jsonl records: step i+1 takes step_times[i]; val_at {step: val_loss}."""
    return [{"step": i + 1, "step_time_s": t, **({"val_loss": val_at[i + 1]} if i + 1 in val_at else {})}
            for i, t in enumerate(step_times)]


def test_run_curve_and_time_to_target() -> None:
    curve = results.run_curve(_records([5.0, 1.0, 2.0, 1.0], {2: 4.0, 4: 3.0}))
    assert curve["steady_step_s"] == 1.0  # median of [1, 2, 1]: the first step (start-up) is left out
    assert curve["val_vs_wall"] == [[6.0, 4.0], [9.0, 3.0]]
    assert results.time_to_target(curve["val_vs_wall"], 3.5) == 9.0
    assert results.time_to_target(curve["val_vs_wall"], 4.0) == 6.0
    assert results.time_to_target(curve["val_vs_wall"], 2.9) is None


def _run(system, seed, step, curve):
    return {"system": system, "preset": "p", "seed": seed, "steady_step_s": step, "val_vs_wall": curve,
            "wall_s": curve[-1][0], "final_val_loss": curve[-1][1], "bytes_per_step": {"tp": 0, "pp": 8, "dp": 0},
            "link_wait_fraction": {"pp": 0.5, "tp": 0.0, "dp": 0.0}}


def test_pooled_rows_target_seeds_and_not_reached() -> None:
    runs = [_run("pipeline", 1, 2.0, [[10.0, 4.0], [20.0, 3.0]]), _run("pipeline", 2, 4.0, [[10.0, 4.0], [30.0, 3.1]]),
            _run("ddp", 1, 1.0, [[5.0, 3.1], [9.0, 3.0]]), _run("sparseloco", 1, 0.5, [[3.0, 5.0], [6.0, 4.0]])]
    rows = {r["system"]: r for r in results.pooled_rows(runs, "pipeline", 0.02)}
    target = 3.05 * 1.02  # mean of the reference's final losses (3.0, 3.1), + 2%: 3.111
    assert rows["pipeline"]["target_val_loss"] == pytest.approx(target)
    assert rows["pipeline"]["time_to_target_s"] == pytest.approx(25.0)  # seeds: 20 s and 30 s
    assert rows["pipeline"]["time_to_target_s_se"] == pytest.approx(5.0)  # stdev 7.07 / sqrt(2)
    assert rows["pipeline"]["steady_step_s"] == 3.0 and rows["pipeline"]["reached"] == "2/2"
    assert rows["ddp"]["time_to_target_s"] == 5.0 and rows["ddp"]["step_time_ratio_vs_pipeline"] == 3.0
    assert rows["sparseloco"]["time_to_target_s"] is None and rows["sparseloco"]["reached"] == "0/1"
    headers, body = results.table(list(rows.values()))
    assert body[-1][headers.index("time to target s")] == "not reached"


def test_headline_puts_three_tiers_beside_dense_3d_and_the_best_single_technique() -> None:
    """Times worked out by hand: three tiers 10 and 12 s (11 ± 1), dense 3D 40 and 44 s (42 ± 2): 3.82x, apart by
    more than 2 s.e. each -> held; the best single technique is the one reaching the target in most seeds (SM in
    2/2 at 20 ± 2 s, not ResBM in 1/2 at 15 s): 1.82x, held; baselines (the pipeline) are not techniques."""
    def run(system, seed, t):  # reaches the target (final 3.0 x 1.02 = 3.06) at t, or never when t is None
        curve = [[5.0, 4.0], [t, 3.0]] if t else [[5.0, 4.0], [50.0, 3.5]]
        return _run(system, seed, 1.0, curve)

    runs = [run("three_tiers", 1, 10.0), run("three_tiers", 2, 12.0), run("dense_3d", 1, 40.0),
            run("dense_3d", 2, 44.0), run("subspace_pipeline", 1, 18.0), run("subspace_pipeline", 2, 22.0),
            run("resbm_pipeline", 1, 15.0), run("resbm_pipeline", 2, None), run("pipeline", 1, 9.0),
            run("pipeline", 2, 9.0)]
    line, equal_wall = results.headline(results.pooled_rows(runs, "dense_3d", 0.02))
    assert line.startswith("p: three tiers 11.0 ± 1.0 s (2/2)") and equal_wall.startswith("p, at equal wall-clock")
    assert "dense_3d 42.0 ± 2.0 s (2/2), three tiers 3.82x sooner (goal >= 3x: held)" in line
    best = "best single technique (subspace_pipeline) 20.0 ± 2.0 s (2/2), three tiers 1.82x sooner (goal >= 1.3x: held)"
    assert best in line
    slow = [r if r["system"] != "three_tiers" else {**r, "val_vs_wall": [[30.0, 3.0]]} for r in runs]
    line = results.headline(results.pooled_rows(slow, "dense_3d", 0.02))[0]
    assert "1.40x sooner (goal >= 3x: not held)" in line and "0.67x sooner (goal >= 1.3x: not held)" in line


def test_equal_wall_clock_compares_every_system_at_the_shortest_runs_training_time() -> None:
    """The shortest run ends its budget at 20 s; each run's loss by then is its last validation at or before 20 s
    (worked out by hand), and the headline orders the systems by it."""
    runs = [_run("pipeline", 1, 1.0, [[10.0, 5.0], [30.0, 4.0], [40.0, 3.0]]),
            _run("pipeline", 2, 1.0, [[12.0, 5.2], [19.0, 4.6], [42.0, 3.1]]),
            _run("sparseloco", 1, 0.5, [[5.0, 5.5], [20.0, 4.4]])]
    rows = {r["system"]: r for r in results.pooled_rows(runs, "pipeline", 0.02)}
    assert rows["pipeline"]["common_wall_s"] == 20.0
    assert rows["pipeline"]["val_loss_at_common_wall"] == pytest.approx(4.8)  # 5.0 (seed 1) and 4.6 (seed 2)
    assert rows["sparseloco"]["val_loss_at_common_wall"] == 4.4
    assert results.loss_by([[10.0, 5.0]], 9.0) is None
    assert results.headline(list(rows.values()))[-1] == (
        "p, at equal wall-clock (20 s of training, the shortest run's): sparseloco 4.400, pipeline 4.800")
    headers, body = results.table(list(rows.values()))
    assert body[0][headers.index("val loss at equal wall-clock")] == "4.800 ± 0.200 at 20 s"


def test_every_system_trains_the_same_budget_and_warm_up() -> None:
    """Systems with their own YAML (the three-tier file: 30 steps, 5 warm-up steps, H = 10) take --steps,
    --val-every, --inner-steps and the shared config's warm-up like every other system."""
    import argparse

    args = argparse.Namespace(config=systems.BASE, tp_preset="nvlink", steps=100, val_every=20, inner_steps=5, set=[])
    for system in ("three_tiers", "dense_3d", "sparseloco", "pipeline"):
        sets = systems.run_overrides(system, "internet-200m-50ms", 1, args)
        assert {"tokens.train_steps=100", "tokens.val_check_interval=20"} <= set(sets), system
        assert ("sparseloco.inner_steps=5" in sets) == (system in ("three_tiers", "sparseloco")), system
    three = systems.run_overrides("three_tiers", "internet-200m-50ms", 1, args)
    assert "optimizer.warmup_steps=10" in three  # cpu_base.yaml's, not the three-tier file's 5


def test_dry_run_resolves_every_system(capsys: pytest.CaptureFixture) -> None:
    names = [s for s, sys_ in systems.SYSTEMS.items() if sys_.config is None]  # three_tiers: its own config
    assert cli.main(["--dry-run", "--seeds", "1", "--systems", *names]) == 0
    out = capsys.readouterr().out
    assert f"{len(names)} run(s)" in out
    for system in names:
        assert f"internet-200m-50ms {system} seed 1" in out
    assert "parallelism.link.dp.preset=internet-200m-50ms" in out and "codec=subspace" in out


def test_the_composed_job_and_its_plain_3d_layout_resolve_with_their_closed_forms(
        capsys: pytest.CaptureFixture) -> None:
    """three_tiers (BTP, subspace on one replica, heterogeneous SparseLoCo) beside dense_3d (Megatron, identity,
    all-reduce) on the same file: both resolve, and the meter's closed-form column follows by hand (b s = 512
    tokens, 2 micro-batches, d = 128, fp32; both replicas, both directions of the one stage link)."""
    import argparse

    assert cli.main(["--dry-run", "--seeds", "1", "--systems", "three_tiers", "dense_3d"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s)" in out and "model.tp_strategy=megatron parallelism.dp_sync=allreduce" in out
    args = argparse.Namespace(config=systems.BASE, tp_preset="nvlink", steps=4, val_every=2, inner_steps=10, set=[])
    dense = runs.closed_forms("dense_3d", "internet-200m-50ms", 1, args)
    three = runs.closed_forms("three_tiers", "internet-200m-50ms", 1, args)
    tokens, d = 2 * 512, 128
    assert dense["pp"] == 2 * 2 * tokens * d * 4 and three["pp"] == 2 * tokens * ((16 * 4 + 4) + d * 4)
    assert three["tp"] < dense["tp"] and three["dp"] < dense["dp"] / 100


def test_anchor_link_scales_protocolnanogpt_to_our_compute() -> None:
    import argparse

    from nanotron_ext.bench.wan.presets import scaled_link, tier_seconds_at_1mbps

    # their compressed step (compute) 19.9 s, uncompressed 100.5 s: communication = 4.05 x compute. Ours: C = 0.5 s
    # and F = 1e6 boundary bytes per step -> the link must move 8e6 bit in 4.05 x 0.5 s; latency 50 ms x 0.5 / 19.9
    at_1mbps = tier_seconds_at_1mbps("pp", {"send:fwd": 5e5, "send:bwd": 5e5}, dp=1, tp=1, pp=2)
    assert at_1mbps == pytest.approx(8.0)
    bw, lat = scaled_link(at_1mbps, 0.5, presets.ANCHORS[presets.ANCHOR].tiers()["pp"])
    assert bw == pytest.approx(8e6 / (80.6 / 19.9 * 0.5) / 1e6) and lat == pytest.approx(50 * 0.5 / 19.9)
    args = argparse.Namespace(anchor_links={presets.ANCHOR: {"pp": (bw, lat)}}, tp_preset="nvlink", steps=4,
                              val_every=2, inner_steps=10, set=[])
    sets = systems.run_overrides("pipeline", presets.ANCHOR, 1, args)
    assert f"parallelism.link.bandwidth_mbps={bw}" in sets and "parallelism.link.preset=" not in " ".join(sets)
    assert f"parallelism.link.dp.bandwidth_mbps={bw}" in sets  # a measured anchor: DP gets the stage link
    assert "parallelism.link.tp.preset=nvlink" in sets
    assert bw == pytest.approx(3.9503, abs=1e-4)
    # ResBM Table 3: 7530 tok/s compute-bound vs 609 over 80 Mbit/s half duplex: communication 11.36 x compute;
    # half duplex: forward and backward share one budget, as the emulator charges them
    resbm = presets.ANCHORS["resbm-80m-cpu"].tiers()["pp"]
    half = tier_seconds_at_1mbps("pp", {"send:fwd": 5e5, "send:bwd": 5e5}, 1, 1, 2, "half")
    bw, lat = scaled_link(half, 0.5, resbm)
    assert bw == pytest.approx(2 * 8e6 / ((7530 - 609) / 609 * 0.5) / 1e6) and lat == 0.0
    args.anchor_links = {"resbm-80m-cpu": {"pp": (bw, lat)}}
    sets = systems.run_overrides("resbm_pipeline", "resbm-80m-cpu", 1, args)
    assert "parallelism.link.duplex=half" in sets and "parallelism.link.dp.duplex=half" in sets


def test_modelled_presets_carry_the_real_settings_ratio_per_tier() -> None:
    """internet-1g-cpu: heterogeneous SparseLoCo's 512M (d = 1536, 4 stages, 8 replicas, 32 x 2048 tokens per
    replica step) on 100 TFLOP/s GPUs over 1 Gbit/s: a stage link carries 2 x T x d bf16 values per step, a stage's
    DP ring all-reduces its quarter of the fp32 gradients (2 (M-1)/M of it per rank). boost-*: BOOST's 7B at
    TP 4 x PP 2 (Megatron: 2 all-reduces of b s d bf16 per layer each way, + 2 for the embedding and head)."""
    from nanotron_ext.bench.wan.presets import ANCHORS
    from nanotron_ext.models.param_count import count_config_file

    n = count_config_file(systems.REPO / "reproduce/het_sparseloco/sparseloco_512m.yaml", uncompressed=True)
    tokens = 32 * 2048
    compute = 6 * n * tokens / 4 / 100e12
    tiers = ANCHORS["internet-1g-cpu"].tiers()
    assert tiers["pp"].comm_over_compute == pytest.approx(2 * tokens * 1536 * 2 * 8 / 1e9 / compute)
    assert tiers["dp"].comm_over_compute == pytest.approx(2 * 7 / 8 * n / 4 * 4 * 8 / 1e9 / compute, rel=1e-3)
    assert tiers["dp"].latency_ms_per_compute_s == pytest.approx(10 / compute)

    n7 = count_config_file(systems.REPO / "reproduce/boost/llama_7b_fullrank.yaml")
    b_s = 4 * 4096
    compute7 = 6 * n7 * b_s / 8 / 100e12
    per_rank = (4 * 32 + 2) * b_s * 4096 * 2 / 2  # both directions, all layers, over 2 stages
    for name, gbytes_s in (("boost-nvlink-cpu", 300), ("boost-pcie-cpu", 32)):
        tp = ANCHORS[name].tiers()["tp"]
        assert tp.comm_over_compute == pytest.approx(2 * 3 / 4 * per_rank / (gbytes_s * 1e9) / compute7, rel=1e-3)
    assert ANCHORS["boost-pcie-cpu"].tiers()["tp"].comm_over_compute > 9 * ANCHORS[
        "boost-nvlink-cpu"].tiers()["tp"].comm_over_compute


def test_calibrated_tiers_get_their_own_links_and_the_rest_their_defaults() -> None:
    """Before calibration (a dry run) each tier shows its unscaled real link; after, its scaled one; a tier the
    preset does not calibrate keeps the stage link (DP) or --tp-preset (TP)."""
    from nanotron_ext.bench.wan.presets import tier_links

    dry = tier_links("internet-1g-cpu", None, "nvlink")
    assert {"parallelism.link.bandwidth_mbps=1000.0", "parallelism.link.dp.bandwidth_mbps=1000.0",
            "parallelism.link.dp.latency_ms=10.0", "parallelism.link.tp.preset=nvlink"} <= set(dry)
    scaled = tier_links("boost-pcie-cpu", {"tp": (12.5, 0.01), "pp": (99.0, 0.002)}, "nvlink")
    assert {"parallelism.link.tp.bandwidth_mbps=12.5", "parallelism.link.bandwidth_mbps=99.0",
            "parallelism.link.dp.bandwidth_mbps=99.0"} <= set(scaled)
    assert not any("tp.preset" in k for k in scaled)


def test_calibration_measures_each_tier_once_and_scales_every_preset(monkeypatch, tmp_path) -> None:
    """Two presets needing pp, dp and tp: three calibration runs (pipeline, ddp, megatron_tp), each tier's link
    from its run's bytes and compute step; the pipeline's other bytes (headers, the emulator's clock) do not count."""
    import argparse
    import json

    from nanotron_ext.bench import training

    launched = []

    def fake_run(config, sets, name, nproc, root, timeout_s, reuse):
        launched.append((name, nproc))
        run_dir = tmp_path / name
        run_dir.mkdir()
        step = {"anchor_calibration_pp": 0.5, "anchor_calibration_dp": 0.4, "anchor_calibration_tp": 0.8}[name]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0, "step_time_s": step}) + "\n"
                                                       for i in range(1, 5)))
        comm = {"pp": 1e9 + 1e6, "pp:send:fwd": 5e5, "pp:send:bwd": 5e5, "pp:send:link-clock": 1e9, "dp": 2e6,
                "tp": 4e6, "world": 48}  # a summary's keys: tiers' totals, the pipeline's sends by direction
        return {"run_dir": str(run_dir), "comm_bytes_per_step": comm}

    monkeypatch.setattr(training, "run_training", fake_run)
    args = argparse.Namespace(preset=["internet-1g-cpu", "boost-pcie-cpu"], config=systems.BASE, calibration_steps=4,
                              set=[], runs=str(tmp_path), timeout_s=60, reuse=False)
    got = runs.calibrate_anchors(args)
    assert sorted(launched) == [("anchor_calibration_dp", 2), ("anchor_calibration_pp", 2),
                                ("anchor_calibration_tp", 2)]
    links = got["links_mbps_ms"]
    internet = presets.ANCHORS["internet-1g-cpu"].tiers()
    assert links["internet-1g-cpu"]["pp"][0] == pytest.approx(8.0 / (internet["pp"].comm_over_compute * 0.5), 1e-3)
    dp_at_1mbps = 2 * 1 / 2 * (2e6 / 2) * 8 / 1e6  # dp = 2: each rank all-reduces its half of the ledger's sum
    assert links["internet-1g-cpu"]["dp"][0] == pytest.approx(dp_at_1mbps / (internet["dp"].comm_over_compute * 0.4),
                                                              1e-3)
    pcie = presets.ANCHORS["boost-pcie-cpu"].tiers()
    tp_at_1mbps = 2 * 1 / 2 * (4e6 / 2) * 8 / 1e6
    assert links["boost-pcie-cpu"]["tp"][0] == pytest.approx(tp_at_1mbps / (pcie["tp"].comm_over_compute * 0.8), 1e-3)
    assert set(got["sources"]) == {"internet-1g-cpu", "boost-pcie-cpu"}


@pytest.mark.slow
def test_tiny_meter_run_writes_its_result(tmp_path, small_corpus) -> None:
    """One system, two steps, through the real trainer: the JSON, markdown and PNG, its bytes and waits."""
    import json

    from tests.conftest import SMALL_VOCAB

    out = tmp_path / "wan.json"
    corpus = [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
              f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]
    assert cli.main(["--systems", "ddp", "--steps", "2", "--val-every", "2", "--seeds", "1", "--reference", "ddp",
                     "--runs", str(tmp_path / "runs"), "--out", str(out),
                     *[x for c in corpus for x in ("--set", c)]]) == 0
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert row["system"] == "ddp" and row["reached"] == "1/1"  # its own final loss is within its own target
    assert row["bytes_per_step"]["dp"] > 0 and row["bytes_per_step"]["pp"] == 0
    assert row["link_wait_fraction"]["dp"] > 0
    [run] = data["runs"]  # each rank's CPU seconds, and the run's link / compute ratio beside the clock's
    check = run["compute_check"]
    assert len(check["rank_cpu_step_s"]) == 2 and min(check["rank_cpu_step_s"]) > 0 and check["compute_step_s"] > 0
    assert check["clock_link_over_compute"][1] > 0 and min(check["compute_stretch"]) > 0
    assert isinstance(check["ratio_flag"], bool)
    assert "Compute check" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()


def _fake_run(log: list):
    """A measure_run stand-in: 0.5 s of waiting (as a run's launch mostly is), a run whose numbers follow from its
    system and seed."""
    import time

    def run(system, preset, seed, args):
        start = time.monotonic()
        time.sleep(0.5)
        log.append((system, seed, start, time.monotonic()))
        step = 1.0 + seed / 10 + (system == "ddp")
        return {"system": system, "preset": preset, "seed": seed, "steady_step_s": step,
                "val_vs_wall": [[step, 5.0], [2 * step, 4.0 + seed / 100]], "final_val_loss": 4.0 + seed / 100,
                "bytes_per_step": {t: 1.0 for t in presets.TIERS}, "closed_form_bytes_per_step": {},
                "link_wait_fraction": {}}
    return run


def test_jobs_run_side_by_side_and_merge_pools_results_like_one_run(tmp_path, monkeypatch, capsys) -> None:
    """--jobs 2 overlaps the runs and keeps their order; --merge of two results (a seed each) gives the rows one
    result of both seeds gives; merging results of different budgets is refused naming the key."""
    import json

    log: list = []
    monkeypatch.setattr(runs, "measure_run", _fake_run(log))
    base = ["--systems", "pipeline", "ddp", "--steps", "4", "--jobs", "2"]
    assert cli.main([*base, "--seeds", "1", "2", "--out", str(tmp_path / "both.json")]) == 0
    (_, _, s0, e0), (_, _, s1, e1) = sorted(log, key=lambda r: r[2])[:2]
    assert s1 < e0, log  # the second run started before the first ended
    both = json.loads((tmp_path / "both.json").read_text())
    order = [("pipeline", 1), ("pipeline", 2), ("ddp", 1), ("ddp", 2)]
    assert [(r["system"], r["seed"]) for r in both["runs"]] == order
    for seed in (1, 2):
        assert cli.main([*base, "--seeds", str(seed), "--out", str(tmp_path / f"s{seed}.json")]) == 0
    assert cli.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"),
                     "--out", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["rows"] == both["rows"] and merged["meta"]["merged_from"] == [str(tmp_path / "s1.json"),
                                                                              str(tmp_path / "s2.json")]
    assert cli.main([*base, "--steps", "8", "--seeds", "3", "--out", str(tmp_path / "s3.json")]) == 0
    assert cli.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s3.json"),
                     "--out", str(tmp_path / "bad.json")]) == 2
    assert f"--merge {tmp_path / 's3.json'}: steps 8 differs" in capsys.readouterr().err
    # a later result timed to another reference pools under the first's; calibrated links must be the same
    links = {"internet-1g-cpu": {"pp": [9.3, 5.6]}}
    for name, reference, pp in (("a", "pipeline", [9.3, 5.6]), ("b", "ddp", [9.3, 5.6]), ("c", "ddp", [20.0, 5.6])):
        saved = json.loads((tmp_path / ("s1.json" if name == "a" else "s2.json")).read_text())
        saved["meta"].update(reference=reference, anchor_calibration={"links_mbps_ms": {"internet-1g-cpu": {"pp": pp}}})
        (tmp_path / f"{name}.json").write_text(json.dumps(saved))
    assert cli.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                     str(tmp_path / "ab.json")]) == 0
    ab = json.loads((tmp_path / "ab.json").read_text())
    assert ab["rows"] == both["rows"] and ab["meta"]["anchor_calibration"]["links_mbps_ms"] == links
    assert [b["from"] for b in ab["meta"]["batches"]] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert cli.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out",
                     str(tmp_path / "ac.json")]) == 2
    err = capsys.readouterr().err
    assert f"--merge {tmp_path / 'c.json'}: its calibrated links of internet-1g-cpu" in err
    assert "--calibration-from" in err


def test_calibration_from_an_earlier_result_gives_its_links_without_calibrating(tmp_path, monkeypatch,
                                                                                capsys) -> None:
    """--calibration-from reuses a saved result's scaled links (what a run added to it must get to be pooled with
    it): the runs carry them and nothing is calibrated; a result without them, or without that preset's, is refused
    naming the file."""
    import json

    monkeypatch.setattr(runs, "calibrate_anchors", lambda args: pytest.fail("calibrated again"))
    links = {"internet-1g-cpu": {"pp": [9.3058, 5.5969], "dp": [18.741, 4.3705]}}
    saved = tmp_path / "earlier.json"
    saved.write_text(json.dumps({"meta": {"anchor_calibration": {"links_mbps_ms": links}}, "rows": []}))
    args = ["--preset", "internet-1g-cpu", "--systems", "sparseloco", "--seeds", "1", "--dry-run"]
    assert cli.main([*args, "--calibration-from", str(saved)]) == 0
    out = capsys.readouterr().out
    for key in ("parallelism.link.bandwidth_mbps=9.3058", "parallelism.link.latency_ms=5.5969",
                "parallelism.link.dp.bandwidth_mbps=18.741", "parallelism.link.dp.latency_ms=4.3705"):
        assert key in out, key
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": {"anchor_calibration": {"links_mbps_ms": {"boost-pcie-cpu": {}}}}}))
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"meta": {}, "rows": []}))
    for path, expected in ((other, "it calibrated boost-pcie-cpu, not --preset internet-1g-cpu"),
                           (none, "its meta has no anchor_calibration")):
        assert cli.main([*args, "--calibration-from", str(path)]) == 2
        assert f"--calibration-from {path}: {expected}" in capsys.readouterr().err


def test_a_failed_run_names_itself_and_keeps_the_finished_ones_for_reuse(tmp_path, monkeypatch, capsys) -> None:
    """One run failing (after hours of others) names the run and says --reuse reads the finished ones back."""
    log: list = []
    fake = _fake_run(log)

    def run(system: str, preset: str, seed: int, args):
        if system == "ddp" and seed == 2:
            raise RuntimeError("boom")
        return fake(system, preset, seed, args)

    monkeypatch.setattr(runs, "measure_run", run)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--systems", "pipeline", "ddp", "--steps", "4", "--seeds", "1", "2", "--jobs", "2",
                  "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "r.json")])
    assert "1 of 4 runs failed" in str(stop.value) and "--reuse" in str(stop.value)
    assert "run internet-200m-50ms ddp seed 2 failed: RuntimeError('boom')" in capsys.readouterr().err
    assert len(log) == 3 and not (tmp_path / "r.json").exists()
