"""The loss-scale study (nanotron_ext/bench/wan/scales.py, issue 51 items 3 and 7). References: closed-form parameter
counts of a Llama block (float arithmetic, not the model code), a full run's own first steps (against stop_after),
hand-computed steps to target and penalties from made-up curves, and the README's literal commands."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

import pytest

from nanotron_ext.bench.wan import losses, scales, systems

README = systems.REPO / "reproduce" / "wan" / "README.md"


def _non_embedding(d: int, ffn: int, heads: int, kv_heads: int, layers: int) -> int:
    """A Llama block without biases: q and o d x d, k and v d x (kv_heads x d / heads), SwiGLU 3 x d x ffn, two
    RMSNorm weights; one final norm."""
    kv = kv_heads * d // heads
    return layers * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + d


def test_d128_runs_are_the_meters_own_and_d256_is_4x_its_non_embedding_parameters() -> None:
    assert scales.size_overrides("d128") == []
    meter = losses.loss_runs(["dense_3d", "three_tiers"], [1], scales.size_args("d128", 150))
    assert [r.key() for r in scales.planned("d128", ["dense_3d", "three_tiers"], 150, [1])] == [r.key() for r in meter]
    small, large = scales.model_size("d128"), scales.model_size("d256")
    assert small["non_embedding_params"] == _non_embedding(128, 384, 4, 2, 4)
    assert large["non_embedding_params"] == _non_embedding(256, 768, 8, 4, 4)
    # every matrix 4x (d^2 terms); only the norm weights (1.6% at d = 128) grow 2x: 3.997x in all
    assert 3.99 < large["non_embedding_params"] / small["non_embedding_params"] < 4
    assert large["tokens_per_step"] == small["tokens_per_step"] == 2048
    sets = dict(o.split("=", 1) for o in scales.size_overrides("d256"))
    assert (sets["model.low_rank.rank"], sets["model.subspace.k"]) == ("64", "32")  # d/4 and d/8, as 32 and 16 at 128


def test_d256_keeps_sparselocos_64x64_tiles_whole() -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.models.param_count import param_shapes

    run = scales.planned("d256", ["three_tiers"], 300, [1])[0]
    matrices = [s for s in param_shapes(load_config(run.config_file, list(run.overrides))) if len(s) == 2]
    assert matrices and all(n % 64 == 0 for s in matrices for n in s), matrices


def test_the_nesterov_twin_differs_from_dense_diloco_only_in_the_outer_step() -> None:
    from nanotron_ext.config.loader import config_to_dict, load_config

    def resolved(system: str) -> Dict[str, object]:
        run = scales.planned("d128", [system], 300, [1])[0]
        return config_to_dict(load_config(run.config_file, list(run.overrides)))["sparseloco"]

    plain, nesterov = resolved("3d_diloco"), resolved("3d_diloco_nesterov")
    differ = {k: (plain[k], nesterov[k]) for k in plain if plain[k] != nesterov[k]}
    assert differ == {"outer_lr": (1.0, 0.7), "outer_momentum": (0.0, 0.9), "outer_nesterov": (False, True)}
    assert nesterov["topk"] == nesterov["chunk"] and nesterov["compressed_replicas"] == []  # every entry sent


def test_stop_after_trains_the_first_steps_of_the_same_schedule(small_corpus: Path) -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.simulated import run_replicas
    from tests.conftest import SMALL_VOCAB

    sets = [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}", "tokens.train_steps=4",
            "optimizer.warmup_steps=1", "parallelism.pp=1", "tokens.val_steps=1"]
    cfg = load_config(systems.REPO / systems.BASE, sets)
    full = run_replicas(cfg, 1, val_every=2)
    first = run_replicas(cfg, 1, val_every=2, stop_after=2)
    assert first["val_curve"] == [full["val_curve"][0]] and first["val_curve"][0][0] == 2
    assert first["train_loss"] == full["train_loss"][:2]


def _record(run: losses.LossRun, curve: List[List[float]]) -> Dict[str, object]:
    return {"system": run.system, "seed": run.seed, "key": run.key(), "val_curve": curve,
            "final_val_loss": curve[-1][1], "train_loss": [], "steps": curve[-1][0], "train_s": 10.0}


def test_report_reads_penalties_from_the_cache(tmp_path: Path) -> None:
    """Dense ends at 4.05 and 4.15 (target 4.1 x 1.02 = 4.182); int4 reaches it within dense's budget; three tiers
    only at 3x the budget (its short runs stay cached and are not read); the Nesterov twin in 1 of 2 seeds."""
    def write(system: str, budget: int, seed: int, curve: List[List[float]]) -> None:
        run = scales.planned("d128", [system], budget, [seed])[0]
        (tmp_path / f"{system}_seed{seed}_{run.key()}.json").write_text(json.dumps(_record(run, curve)))

    s, long = scales.REFERENCE_STEPS, scales.LONG_STEPS
    a, b = s // 3, 2 * s // 3  # two validations before the last
    write("dense_3d", s, 1, [[a, 5.0], [b, 4.1], [s, 4.05]])
    write("dense_3d", s, 2, [[a, 5.0], [b, 4.3], [s, 4.15]])
    write("3d_int4", s, 1, [[a, 5.0], [b, 4.5], [s, 4.18]])
    write("3d_int4", s, 2, [[a, 5.0], [b, 4.5], [s, 4.1]])
    write("three_tiers", s, 1, [[s, 5.0]])
    for seed, hit in ((1, 2 * s), (2, 2 * s + s // 2)):
        write("three_tiers", long, seed, [[s, 5.0], [hit, 4.15], [long, 4.0]])
    write("3d_diloco_nesterov", s, 1, [[b, 4.1], [s, 4.0]])
    write("3d_diloco_nesterov", s, 2, [[b, 4.5], [s, 4.3]])
    out = scales.size_result("d128", tmp_path)
    assert out is not None and out["target"] == pytest.approx(4.1 * 1.02)
    rows = out["systems"]
    assert rows["dense_3d"]["steps_to_target"] == [b, s] and rows["dense_3d"]["penalty"] == 1.0
    assert rows["3d_int4"]["steps_to_target"] == [s, s]
    assert rows["3d_int4"]["penalty"] == pytest.approx(s / ((b + s) / 2))
    assert (rows["three_tiers"]["budget"], rows["three_tiers"]["reached"]) == (long, "2/2")
    assert rows["three_tiers"]["penalty"] == pytest.approx(2.25 * s / ((b + s) / 2))
    assert rows["3d_diloco_nesterov"]["reached"] == "1/2"  # no longer run cached: the short one is read
    assert rows["3d_diloco_nesterov"]["penalty"] == pytest.approx(b / ((b + s) / 2))
    assert out["epochs_at_longest"] is None or out["epochs_at_longest"] == pytest.approx(
        long * 2048 / out["corpus_tokens"])
    assert scales.best_single(rows) == "3d_int4"


def test_the_readme_names_the_data_every_loss_run_reads() -> None:
    """The README's prepare command is the one whose data the runs read (its prepared_dir, tokenizer and seed)."""
    from nanotron_ext.config.loader import load_config

    text = README.read_text()
    command = re.search(r"python -m nanotron_ext\.data prepare --config-file (\S+)", text)
    assert command is not None, "reproduce/wan/README.md names no data preparation"
    prepared = load_config(systems.REPO / command.group(1))
    assert command.group(1) == systems.BASE and prepared.general.seed == 1
    for size in scales.SIZES:
        for run in scales.planned(size, list(scales.STUDY), scales.REFERENCE_STEPS, [2]):
            cfg = load_config(run.config_file, list(run.overrides))
            assert (cfg.data.prepared_dir, cfg.tokenizer.path, cfg.data.source) == (
                prepared.data.prepared_dir, prepared.tokenizer.path, prepared.data.source), (size, run.system)
    assert "python -m nanotron_ext.bench.wan.scales rerun" in text
