"""`python -m nanotron_ext.advise` (nanotron_ext/advise/): a reshaped plan against a plan made at that layout, the DDP
bound against its closed form, the layouts each system's loss runs allow, the penalties read from the committed
model clock, the hardware file's refusals, and the ranking on internet-1g from the committed plans (datacenter-only
dense above the committed dense 3D layout)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_ext.advise import layouts as L
from nanotron_ext.advise.hardware import Hardware, load, presets
from nanotron_ext.advise.penalties import MODEL_CLOCK, from_model_clock
from nanotron_ext.advise.search import reshape
from nanotron_ext.bench.clock import Link, ReplicaWork, Stage, ddp_step_s, planned, step_bounds
from nanotron_ext.errors import UserFacingError

REPO = Path(__file__).resolve().parents[1]


def _hw(**kw) -> Hardware:  # type: ignore[no-untyped-def]
    base = dict(name="t", source="test", nodes=4, gpus_per_node=2, device_gib=80.0, tflops=100.0, datacenter_nodes=2,
                node_link=(2.4e6, 0.002), datacenter_link=(4e5, 0.002), internet_link=(1000.0, 10.0))
    return Hardware(**{**base, **kw})


def test_layouts_keep_the_loss_runs_math() -> None:
    hw = _hw()
    dense = L.layouts(hw, L.RULES["dense_3d"], 64, 8, 12)
    whole = {(x.dp, x.pp) for x in dense if x.tp == 2}  # a node per stage
    assert whole == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    assert {(x.dp, x.pp) for x in dense if x.tp == 1} >= {(8, 1), (2, 4), (4, 2)}  # two stages per node
    assert {x.pp for x in L.layouts(hw, L.RULES["3d_sm"], 64, 8, 12)} == {2}  # one compressed boundary
    assert {x.dp for x in L.layouts(hw, L.RULES["3d_diloco"], 64, 8, 12)} == {2}  # M = 2 replicas
    het = next(x for x in L.layouts(hw, L.RULES["three_tiers"], 64, 8, 12) if x.tp == 2)
    assert het.nodes == ((2, 3), (0, 1))  # the compressed replica 0 over the internet, replica 1 in the datacenter
    assert L.stage_links(hw, het) == [hw.internet_link, hw.datacenter_link]
    assert L.dp_link(hw, het) == hw.internet_link
    alone = next(x for x in dense if (x.dp, x.tp, x.pp) == (2, 2, 1))
    assert alone.nodes == ((0,), (1,)) and L.dp_link(hw, alone) == hw.datacenter_link  # the datacenter alone
    assert {(x.micro_batch_size, x.micro_batches) for x in dense if (x.dp, x.tp, x.pp) == (2, 2, 1)} == {
        (8, 4), (4, 8), (2, 16)}
    one_node = next(x for x in L.layouts(hw, L.RULES["3d_diloco"], 64, 8, 12) if (x.tp, x.pp) == (1, 1))
    assert one_node.nodes == ((0,), (0,)) and L.dp_link(hw, one_node) == hw.node_link  # DiLoCo on one node
    assert one_node.used_nodes == 1 and one_node.busiest_node_slots == 2
    piped = next(x for x in dense if (x.dp, x.tp, x.pp) == (2, 1, 2))
    assert piped.nodes == ((0, 0), (1, 1)) and L.stage_links(hw, piped) == [hw.node_link] * 2


def test_the_ddp_bound_is_its_closed_form() -> None:
    """One stage, m micro-batches of forward f and backward b, a DP all-reduce of d seconds: DDP starts it with the
    last backward, m f + (m - 1) b, so the step is max(m (f + b), m f + (m - 1) b + d); no overlap adds d."""
    f, b, d, m = 1.0, 2.0, 5.0, 3
    work = ReplicaWork([Stage(f, b)], [], m, "1f1b", dp_s=[d])
    assert ddp_step_s([work], 0) == pytest.approx(max(m * (f + b), m * f + (m - 1) * b + d))
    assert step_bounds([work]).upper_s == pytest.approx(m * (f + b) + d)
    two = ReplicaWork([Stage(f, b, 1e6, 1e6), Stage(f, b, 1e6, 1e6)], [Link(8.0)], m, "1f1b", dp_s=[d, d])
    lo, hi = step_bounds([two]).lower_s, step_bounds([two]).upper_s
    assert lo <= ddp_step_s([two], 0) <= hi


@pytest.mark.slow
def test_a_reshaped_plan_is_the_plan_made_at_that_layout(tmp_path: Path, small_corpus: Path) -> None:
    """Plan dense 3D at dp 2 x pp 2 with 4 micro-batches of 4, reshape it to dp 4 with 2 micro-batches of 8 (and to
    dp 1), and hold FLOPs, every TP / stage / DP payload and the calls to a plan made at that layout."""
    from tests.conftest import SMALL_VOCAB

    base = REPO / "reproduce/wan/cpu_base.yaml"
    sets = [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}", "parallelism.link.enabled=false",
            "parallelism.tp=2", "parallelism.pp=2"]

    def plan(dp: int, mbs: int, m: int) -> dict:
        keys = sets + [f"parallelism.dp={dp}", f"tokens.micro_batch_size={mbs}",
                       f"tokens.batch_accumulation_per_replica={m}"]
        return {**planned(str(base), keys, tmp_path), "micro_batch_size": mbs}

    made = plan(2, 4, 4)
    for dp, mbs, m in ((4, 8, 2), (1, 4, 4)):
        want = plan(dp, mbs, m)
        got = reshape(made, L.Layout(dp, 2, 2, mbs, m, tuple((2 * r, 2 * r + 1) for r in range(dp))))
        for s, (g, w) in enumerate(zip(got["inner"][0], want["inner"][0])):
            assert g["flops"] == pytest.approx(w["flops"], rel=1e-9), s
            for group in ("tp", "pp", "dp"):
                for op, v in w["ledger"].get(group, {}).items():
                    if op.endswith(":meta") or "control" in op:
                        continue  # headers and few-byte agreements: not what the clock prices
                    assert g["ledger"][group][op]["bytes"] == pytest.approx(v["bytes"], rel=0.01), (group, op)
            assert set(g["ledger"].get("dp", {})) == set(w["ledger"].get("dp", {})) - {"all_reduce:control"}


def test_penalties_from_the_committed_model_clock() -> None:
    steps = from_model_clock(MODEL_CLOCK)
    rows = json.loads(MODEL_CLOCK.read_text())["rows"]
    dense = next(r for r in rows if r["system"] == "dense_3d")["steps_to_target"][0]
    three = next(r for r in rows if r["system"] == "three_tiers" and r.get("budget") == "time")
    assert steps["dense_3d"].penalty == 1.0 and steps["dense_3d"].dense_steps == dense == 780.0
    assert steps["three_tiers"].penalty == pytest.approx(three["steps_to_target"][0] / dense)
    assert not steps["three_tiers"].lower_bound and steps["3d_sparseloco"].lower_bound  # never reached: a bound


def test_hardware_files_are_checked(tmp_path: Path) -> None:
    good = {"nodes": 4, "gpus_per_node": 2, "device_gib": 24, "tflops": 23, "datacenter_nodes": 0,
            "node_link": [2.56e5, 0.005], "datacenter_link": [4e5, 0.002], "internet_link": [200, 50]}
    path = tmp_path / "hw.yaml"
    path.write_text(json.dumps(good))
    assert load(path).internet_link == (200, 50)
    for key, value, says in (("nodes", 0, "nodes"), ("internet_link", [0, 1], "internet_link"),
                             ("datacenter_nodes", 5, "datacenter_nodes"), ("colour", 1, "unknown key 'colour'")):
        path.write_text(json.dumps({**good, key: value}))
        with pytest.raises(UserFacingError, match=says):
            load(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "tflops"}))
    with pytest.raises(UserFacingError, match="missing key 'tflops'"):
        load(path)


def test_internet_1g_ranks_datacenter_dense_above_the_committed_dense_3d(tmp_path: Path, capsys) -> None:
    """From the committed plans (no planning here): on internet-1g's hardware dense on the datacenter's 4 GPUs
    (dp 2 x tp 2) reaches the target sooner than the committed dense 3D layout, and its YAML loads."""
    from nanotron_ext.advise.__main__ import main
    from nanotron_ext.config.loader import load_config

    out, cfg = tmp_path / "rank.json", tmp_path / "best.yaml"
    assert main(["--preset", "internet-1g", "--systems", "dense_3d", "--json", str(out),
                 "--write-config", str(cfg)]) == 0
    rows = json.loads(out.read_text())["ranking"]
    names = [r["system"] for r in rows]
    assert names.index("dense_3d") < names.index("dense_3d (committed layout)")
    best = rows[names.index("dense_3d")]
    lay = best["layout_keys"]
    assert lay["dp"] * lay["tp"] == 4 and lay["pp"] == 1  # the datacenter's 4 GPUs, no pipeline
    assert "datacenter only" in best["layout"]
    assert best["time_to_target_s"] < rows[names.index("dense_3d (committed layout)")]["time_to_target_s"] / 5
    loaded = load_config(cfg, [])
    assert (loaded.parallelism.dp, loaded.parallelism.tp, loaded.parallelism.pp) == (lay["dp"], lay["tp"], 1)
    assert main(["--preset", "internet-1g", "--systems", "dense_3d", "--write-config", str(cfg)]) == 0  # ours: kept
    assert "advice: dense" in capsys.readouterr().out
    assert presets()["internet-1g"].datacenter_nodes == 2


@pytest.mark.parametrize("argv, says", [
    (["--hardware", "{hw}"], "--hardware needs --config-file"),
    (["--preset", "nowhere"], "--preset"),
    (["--preset", "internet-1g", "--systems", "bogus"], "--systems"),
])
def test_bad_flags_are_one_line(tmp_path: Path, argv: list, says: str, capsys) -> None:
    from nanotron_ext.advise.__main__ import main

    hw = tmp_path / "hw.yaml"
    hw.write_text("nodes: 1\n")
    with pytest.raises(SystemExit) as e:
        main([a.replace("{hw}", str(hw)) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_a_regime_cell_needs_a_measured_penalty_to_win(monkeypatch) -> None:
    """A system no run brought to the target cannot win a cell; where its lower-bound time beats the winner the
    cell says it is not resolved; the margin is the runner-up's time over the winner's."""
    from nanotron_ext.advise import regime
    from nanotron_ext.advise.layouts import Layout
    from nanotron_ext.advise.penalties import Steps
    from nanotron_ext.advise.ranking import Ranked
    from nanotron_ext.advise.search import Priced

    def row(name: str, step: float, penalty: float, bound: bool = False) -> Ranked:
        lay = Layout(1, 2, 1, 8, 4, ((0,),))
        return Ranked(name, name, Priced(name, lay, step, step, step, "ddp", 1.0, True),
                      Steps(penalty, 100.0, "test", bound), 100.0)

    rows = [row("3d_sparseloco", 1.0, 1.3, bound=True), row("three_tiers", 1.0, 2.0), row("dense_3d", 3.0, 1.0)]
    monkeypatch.setattr(regime, "rank", lambda *a, **k: rows)
    monkeypatch.setattr(regime, "Planner", lambda *a, **k: None)
    steps = {r.name: r.steps for r in rows}
    (cell,) = regime.cells(steps, Path("unused"), sizes=["512M"], links=[100], shares=[0.0])
    assert cell.winner.name == "three_tiers" and cell.runner_up.name == "dense_3d"
    assert cell.margin == pytest.approx(300.0 / 200.0)
    assert cell.unresolved == ("3d_sparseloco",) and cell.as_dict()["composed_wins"]


def test_a_published_loss_gap_becomes_a_token_multiple_on_chinchillas_data_term() -> None:
    """B / (k D)^0.28 = B / D^0.28 - dL, solved for k by hand at heterogeneous SparseLoCo's 512M row (2.82 vs 2.73
    at 10B tokens); no gap is no penalty; a gap the data term cannot close is never reached."""
    from nanotron_ext.advise.penalties import from_papers, tokens_factor

    d, gap = 10e9, 0.09
    k = tokens_factor(gap, d)
    assert 410.7 / (k * d) ** 0.28 == pytest.approx(410.7 / d ** 0.28 - gap, rel=1e-9)
    assert k == pytest.approx(1.70, abs=0.01)
    assert tokens_factor(-0.01, d) == 1.0 and tokens_factor(1.0, d) == float("inf")
    papers = from_papers()
    assert papers["3d_sm_sparseloco"].penalty == pytest.approx(k) and "three_tiers" not in papers


def test_a_streaming_rule_is_headed_by_its_delay_bound_and_a_blocking_one_by_no_overlap(monkeypatch) -> None:
    """From the committed plans (no planning here), each replica on its own internet node of internet-1g: a streaming
    rule (tau = 1, planned as its blocking twin) has the lower bound that hides the outer sync O behind tau inner
    steps only, in closed form L0 + max(0, O - tau L0) / H (L0 the step with no outer sync, O read off the blocking
    twin's no-overlap bound: U0 + O / H). It is headed by that bound only where the DP tier carries no per-step
    agreement; here one job's logged-loss agreement queues behind the sync on the internet link, so it is headed by
    the no-overlap bound like its blocking twin (the clock validation measured as much). The rule's tau is the delay
    its meter system trains with (the loss runs' config), and the twin's config has none."""
    from nanotron_ext.advise import search
    from nanotron_ext.advise.__main__ import CACHE
    from nanotron_ext.advise.ranking import meter_config, reference_of
    from nanotron_ext.advise.search import Planner, bounds, price
    from nanotron_ext.bench.clock import CLOCK_PRESETS
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.registry import DP_SYNCS

    def delay(system: str) -> int:
        cfg = load_config(*meter_config(system))
        return DP_SYNCS.owner(cfg.parallelism.dp_sync).outer_overlap(cfg)

    for name, rule in L.RULES.items():  # every streaming rule's tau is its loss runs' delay; its twin has none
        if rule.outer_overlap:
            assert rule.outer_overlap == delay(name) and delay(rule.plan_as) == 0, name
    hw = presets()["internet-1g"]
    scale = str(REPO / CLOCK_PRESETS["internet-1g"].scale_config)
    reference, _ = reference_of(scale)
    planner = Planner(scale, CACHE, meter_config)
    lay = L.Layout(2, 2, 1, reference["micro_batch_size"], reference["micro_batches"], ((2,), (3,)))
    assert L.dp_link(hw, lay) == hw.internet_link
    # DiLoCo's dense sync outlasts one inner step over the internet (tau = 1 hides part of it); SparseLoCo's top-k
    # payload does not (hidden whole, as by full overlap)
    for stream, block, hidden in (("3d_diloco_nesterov_streaming", "3d_diloco", False),
                                  ("3d_btp_sparseloco_streaming", "3d_btp_sparseloco", True)):
        rule = L.RULES[stream]
        assert rule.plan_as == block and rule.outer_overlap == delay(stream) == 1 and delay(block) == 0
        s, b = price(planner, hw, stream, lay, reference), price(planner, hw, block, lay, reference)
        assert (s.headline, b.headline, b.step_s) == ("upper", "upper", b.upper_s) and s.agreements_s > 0
        assert s.step_s == s.upper_s == pytest.approx(b.upper_s, rel=1e-12)
        plan = reshape(planner.plan(block, L.RULES[block], 2, 1, reference), lay)
        h, inner = plan["outer_every"], bounds({**plan, "outer_every": 0}, hw, lay)
        sync = (b.upper_s - inner["upper_s"]) * h
        assert h == 20 and (sync <= inner["lower_s"]) == hidden and sync > 0
        assert s.lower_s == pytest.approx(inner["lower_s"] + max(0.0, sync - inner["lower_s"]) / h, rel=1e-9)
        real = search.bounds  # with nothing else on the DP tier the streaming rule earns its lower bound
        monkeypatch.setattr(search, "bounds", lambda *a, _real=real: {**_real(*a), "agreements_s": 0.0})
        s0 = price(planner, hw, stream, lay, reference)
        assert s0.headline == "lower" and s0.step_s == s0.lower_s == s.lower_s < b.upper_s
        assert price(planner, hw, block, lay, reference).headline == "upper"
        monkeypatch.setattr(search, "bounds", real)
        assert s.upper_s == pytest.approx(b.upper_s, rel=1e-12) and s.lower_s < b.upper_s
        assert (s.lower_s == pytest.approx(b.lower_s, rel=1e-12)) if hidden else b.lower_s < s.lower_s


def test_later_runs_join_the_model_clock_set_at_its_own_target(tmp_path: Path) -> None:
    """A later meter result's curves are read against model_clock.json's target (dense's final loss x 1.02), not
    their own file's; one with another budget is refused naming the key."""
    saved = json.loads(MODEL_CLOCK.read_text())
    target = next(r for r in saved["rows"] if r["system"] == "dense_3d")["target_val_loss"]
    runs = [{"system": "a", "seed": 1, "val_curve": [[20, 9.0], [400, target - 0.01], [1000, 4.0]]},
            {"system": "a", "seed": 2, "val_curve": [[20, 9.0], [600, target], [1000, 4.0]]},
            {"system": "b", "seed": 1, "val_curve": [[20, 9.0], [1000, target + 0.01]]}]
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"meta": {**saved["meta"], "reference": "a"}, "runs": runs}))
    steps = from_model_clock(MODEL_CLOCK, more=[later])
    assert steps["a"].penalty == pytest.approx(500.0 / 780.0) and not steps["a"].lower_bound
    assert steps["b"].penalty == pytest.approx(1000.0 / 780.0) and steps["b"].lower_bound
    assert steps["three_tiers"] == from_model_clock(MODEL_CLOCK, more=[])["three_tiers"]  # the rest unchanged
    later.write_text(json.dumps({"meta": {**saved["meta"], "inner_steps": 10}, "runs": runs}))
    with pytest.raises(UserFacingError, match="meta.inner_steps is 10"):
        from_model_clock(MODEL_CLOCK, more=[later])
