"""ResBM (arXiv:2604.11947) configs: the 2B parameter counts of appendix A.3 on the meta device, and the
paper's optimiser set-up (Muon on hidden matrices incl. E/D, AdamW elsewhere, RMS-matched Muon, 1% / 10%
final lr) reached from the committed YAML."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
REPRO = REPO / "reproduce" / "resbm"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _counts() -> dict:
    from nanotron_ext.config.loader import load_config

    counts = _load(REPRO / "param_counts.py", "resbm_param_counts")
    return {n: counts.count_params(load_config(REPRO / f"resbm_2b_{n}.yaml"))
            for n in ("baseline", "128x_muon", "100x_muon")}


@pytest.mark.slow
def test_2b_parameter_counts_on_meta_device() -> None:
    got = run_distributed(_counts, 1)[0]
    assert got["baseline"] == 1_896_751_104  # the paper's number, exactly
    # 7 pairs of halves d -> 1024 -> h and h -> 1024 -> d (the paper's 1,960,157,184 has 15 halves)
    assert got["128x_muon"] - got["baseline"] == 14 * 1024 * (4096 + 32)
    assert got["100x_muon"] - got["baseline"] == 14 * 1024 * (4096 + 40)
    assert 1_960_157_184 - got["baseline"] == 15 * 1024 * (4096 + 32)


def test_committed_configs_match_their_generator() -> None:
    assert _load(REPRO / "make_configs.py", "resbm_make_configs").main(["--check"]) == 0


class _Toy(nn.Module):
    """Parameter names as in the real model (the optimiser split is by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(50, 16)
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.norm = nn.LayerNorm(16, bias=False)
        layer.mlp.down_proj = nn.Linear(24, 16, bias=False)
        layer.boundary_encoder = nn.Module()
        layer.boundary_encoder.net = nn.Sequential()
        layer.boundary_encoder.net.fc1 = nn.Linear(16, 8, bias=False)
        layer.boundary_encoder.net.fc2 = nn.Linear(8, 4, bias=False)
        self.decoder = nn.ModuleList([layer])
        self.lm_head = nn.Linear(16, 50, bias=False)


def test_resbm_muon_optimiser_from_yaml() -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.optim.lr_schedule import build_scheduler

    total = 40
    cfg = load_config(REPRO / "resbm_2b_128x_muon.yaml",
                      ["optimizer.warmup_steps=5", "optimizer.weight_decay=0"]).optimizer
    assert (cfg.lr, cfg.muon_lr, cfg.min_lr_ratio, cfg.muon_min_lr_ratio) == (2e-4, 2e-4, 0.01, 0.1)
    model = _Toy()
    opt = build_optimizer(model, cfg, None)
    sched = build_scheduler(opt, cfg, total_steps=total)
    groups = {g["name"]: g for g in opt.param_groups}
    muon_ids = {id(p) for p in groups["muon"]["params"]}
    hidden = [model.decoder[0].mlp.down_proj.weight, model.decoder[0].boundary_encoder.net.fc1.weight,
              model.decoder[0].boundary_encoder.net.fc2.weight]
    assert muon_ids == {id(p) for p in hidden}  # E (and D) and hidden matrices on Muon; nothing else
    assert groups["muon"]["adjust_lr_fn"] == "match_rms_adamw"
    # RMS-matched Muon: an update's RMS is ~0.2 x lr whatever the shape (orthogonal O of shape A x B has
    # RMS 1/sqrt(max(A, B)), scaled by 0.2 sqrt(max(A, B)))
    w = model.decoder[0].boundary_encoder.net.fc1.weight
    before, lr_now = w.detach().clone(), groups["muon"]["lr"]  # peak / warmup_steps at step 0
    assert math.isclose(lr_now, 2e-4 / 5)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    rms = (w.detach() - before).pow(2).mean().sqrt().item()
    assert 0.12 * lr_now <= rms <= 0.28 * lr_now, rms / lr_now
    lrs = []
    for _ in range(total):
        lrs.append({name: g["lr"] for name, g in zip([g["name"] for g in opt.param_groups], opt.param_groups)})
        sched.step()
    assert math.isclose(lrs[-1]["muon"], 0.1 * 2e-4, rel_tol=1e-9)
    assert math.isclose(lrs[-1]["adamw_decay"], 0.01 * 2e-4, rel_tol=1e-9)
    assert math.isclose(lrs[4]["muon"], 2e-4) and math.isclose(lrs[4]["adamw_no_decay"], 2e-4)


def test_muon_adjust_lr_and_floor_are_validated() -> None:
    from nanotron_ext.config.schema import ConfigError, OptimizerConfig

    with pytest.raises(ConfigError, match="optimizer.muon_min_lr_ratio"):
        OptimizerConfig(muon_min_lr_ratio=1.5)
    from nanotron_ext.config.loader import load_config

    with pytest.raises(Exception, match="muon_adjust_lr"):
        load_config(REPRO / "resbm_2b_128x_muon.yaml", ["optimizer.muon_adjust_lr=bogus"])


def _with_singular_values(s: torch.Tensor, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))[0]
    return u @ torch.diag(s) @ v.T


def test_effective_rank_closed_form_and_cli_on_a_checkpoint(tmp_path: Path) -> None:
    import json

    from nanotron_ext.resbm.analyse import effective_rank, main, normalised_spectrum, singular_values

    s = torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    w = _with_singular_values(s, 8, 6, 0)
    assert math.isclose(effective_rank(singular_values(w)), (16 + 4 + 1 + 1) / 16, rel_tol=1e-12)
    assert normalised_spectrum(singular_values(w)) == pytest.approx([1.0, 0.5, 0.25, 0.25, 0, 0], abs=1e-12)
    flat = _with_singular_values(torch.full((5,), 3.0, dtype=torch.float64), 5, 12, 1)
    assert math.isclose(effective_rank(singular_values(flat)), 5.0, rel_tol=1e-12)  # all equal: the rank
    # a checkpoint in the trainer's layout: step_<N>/meta.json + one file per (pp, dp, tp) rank
    step = tmp_path / "ckpt" / "step_7"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 7, "tp": 1, "pp": 2, "dp": 1}))
    enc0 = "decoder.0.pp_block.boundary_encoder.net.fc2.weight"
    enc2 = "decoder.2.pp_block.boundary_encoder.net.fc2.weight"
    torch.save({"model": {enc0: w.float(), "decoder.0.pp_block.mlp.norm.weight": torch.ones(6)}},
               step / "pp0_dp0_tp0.pt")
    torch.save({"model": {enc2: flat.float()}}, step / "pp1_dp0_tp0.pt")
    out = tmp_path / "out"
    result = main(["--checkpoint", str(tmp_path / "ckpt"), "--label", "run", "--out", str(out)])
    assert result["run"][enc0]["r_eff"] == pytest.approx(22 / 16, rel=1e-5)
    assert result["run"][enc2]["r_eff"] == pytest.approx(5.0, rel=1e-5)
    assert set(result["run"]) == {enc0, enc2}
    assert (out / "spectra.png").stat().st_size > 0 and (out / "effective_rank.json").exists()


def test_slow_link_arithmetic_and_table3_verdict() -> None:
    sl = _load(REPO / "nanotron_ext" / "bench" / "slow_link.py", "slow_link")
    t3 = _load(REPRO / "table3_throughput.py", "resbm_table3")
    assert sl.parse_setting("resbm:model.codec.kind=resbm,model.codec.resbm.h=2") == (
        "resbm", ["model.codec.kind=resbm", "model.codec.resbm.h=2"])
    # the paper's uncompressed 80 Mbit/s row: 2 x 4096 bf16 values per token and boundary on one budget
    per_token = 4096 * 2
    assert sl.link_bound_tokens_per_s(1024, 1024 * per_token, 1024 * per_token, 80,
                                      "half") == pytest.approx(610.35, abs=0.01)
    assert sl.link_bound_tokens_per_s(1024, 1024 * per_token, 1024 * per_token, 80,
                                      "full") == pytest.approx(1220.7, abs=0.1)
    assert sl.link_bound_tokens_per_s(1024, 5, 5, 0, "half") is None
    metrics = [{"step": i, "loss": 10 - i, "step_time_s": 2.0} for i in range(1, 6)]
    assert sl.loss_within(metrics, 6.5) == 7 and sl.loss_within(metrics, 1.0) is None
    from nanotron_ext.bench.paper import evaluate

    def rows(res: float, fast: float, slow: float) -> list:
        def r(setting: str, mbps: float, tps: float, b: int) -> dict:
            return {"setting": setting, "bandwidth_mbps": mbps, "tokens_per_s": tps,
                    "bytes_per_step_per_boundary": {"fwd": b, "bwd": b}}
        return [r("resbm_128x", 1.6, res, 1), r("uncompressed", 200.0, fast, 128), r("uncompressed", 1.6, slow, 128)]

    comps = {c["key"]: c["value"] for c in t3.comparisons(rows(95, 100, 10), 1.6, 200.0)}
    assert comps["resbm@slow / uncompressed@fast"] == pytest.approx(0.95)
    assert comps["uncompressed fast / slow"] == pytest.approx(10.0) and comps["bytes fwd: uncompressed / resbm"] == 128
    verdicts = {v.claim.name: v for v in evaluate(t3.CLAIMS, t3.comparisons(rows(95, 100, 10), 1.6, 200.0))}
    assert [v.held for v in verdicts.values() if v.measured is not None][:2] == [True, True]
    assert all(v.status == "held" for n, v in verdicts.items() if n.startswith("boundary bytes"))  # exact
    assert all(v.status == "undetermined (1 run)" for n, v in verdicts.items() if "tokens/s" in n and v.measured)
    v = [v.held for v in evaluate(t3.CLAIMS, t3.comparisons(rows(80, 100, 30), 1.6, 200.0))][:2]
    assert v == [False, False]


def test_slow_link_median_throughput_ignores_the_first_step_and_outliers() -> None:
    sl = _load(REPO / "nanotron_ext" / "bench" / "slow_link.py", "slow_link")
    metrics = [{"step_time_s": t, "loss": 1.0} for t in (30.0, 1.0, 1.0, 9.0, 1.0)]
    assert sl.median_tokens_per_s(metrics, 1000) == 1000.0


def test_resbm_config_validation_names_the_keys() -> None:
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import ConfigError
    from nanotron_ext.resbm.config import ResBMConfig

    assert ResBMConfig(ratio=128).width(4096) == 32 and ResBMConfig(h=40).width(4096) == 40
    with pytest.raises(ConfigError, match="model.codec.resbm"):
        ResBMConfig(h=4, ratio=2)
    with pytest.raises(ConfigError, match="model.codec.resbm.h"):
        ResBMConfig(h=256).width(256)
    with pytest.raises(ConfigError, match="model.codec.resbm.ratio"):
        ResBMConfig(ratio=0.5)
    with pytest.raises(Exception, match="nonlinearity"):
        from_dict(ResBMConfig, {"h": 4, "nonlinearity": "swish"}, "model.codec.resbm")
