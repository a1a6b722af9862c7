"""Every YAML users start from loads with the strict loader and describes a runnable layout; every example in
examples/ also builds its model at its own layout and takes one real training step (a config that only failed
at model build, or at its first step, used to pass here)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from nanotron_ext.config.loader import config_to_dict, load_config
from nanotron_ext.config.yaml_io import read_yaml
from tests.helpers.dist import run_distributed

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CONFIGS = EXAMPLES + sorted((REPO / "reproduce").glob("**/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_loads_and_validates(path: Path) -> None:
    """It loads and validates at its own world size, and every key the file sets keeps the file's value (a
    loader that dropped or defaulted a key would pass on loading alone); keys set to null are resolved."""
    cfg = load_config(path)
    p = cfg.parallelism
    cfg.validate(world_size=p.dp * p.tp * p.pp)
    written, loaded = _flat(read_yaml(path)), _flat(config_to_dict(cfg))
    changed = {k: (v, loaded.get(k, "missing")) for k, v in written.items() if v is not None and loaded.get(k) != v}
    assert not changed, changed
    assert written, "an empty example"


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _one_step_worker(path: Path, overrides: list) -> dict:
    import functools

    import torch

    from nanotron_ext.train.trainer import Trainer

    # model.compile as written compiles the layers in place; inductor's C++ code generation for them costs ~30 CPU-s
    # from a cold cache (every CI run). AOT autograd traces the same graphs (what breaks), as test_gpu_check's
    # compile test and the GPU check's dry run do; compiled numbers equal eager ones there.
    torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")

    trainer = Trainer(load_config(path, overrides))
    before = {n: p.detach().clone() for n, p in trainer.replica.model.named_parameters()}
    summary = trainer.train()
    moved = sum(not torch.equal(before[n], p) for n, p in trainer.replica.model.named_parameters())
    compiled = [getattr(b.pp_block, "_compiled_call_impl", None) is not None for b in trainer.replica.model.decoder
                if getattr(b, "pp_block", None) is not None]
    return {"summary": summary, "moved": moved, "params": len(before), "vocab": trainer.cfg.model.vocab_size,
            "compiled": compiled}


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_builds_its_model_and_takes_one_step(path: Path, small_corpus: Path, tmp_path: Path) -> None:
    """The example's model, layout, optimiser, dtype, links and outer loop as written; only the data (the small
    test corpus), the folders and, for the GPU-sized example, the tokens per step are replaced."""
    cfg = load_config(path)
    p = cfg.parallelism
    overrides = [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
                 f"general.output_dir={tmp_path}", f"checkpoints.dir={tmp_path / 'ckpt'}", "logging.progress_bar=false",
                 "tokens.train_steps=1", "tokens.val_steps=1", "checkpoints.resume=never"]
    if cfg.tokens.sequence_length * cfg.tokens.micro_batch_size > 4096:  # 125m_gpu: 64k tokens a step on CPU
        overrides += ["tokens.sequence_length=32", "tokens.micro_batch_size=1",
                      f"tokens.batch_accumulation_per_replica={max(1, p.pp - 1)}"]
    lighthouse = None
    if cfg.sparseloco.fault_tolerance.enabled:  # its replica meets the others at a torchft lighthouse: one here
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50)
        overrides.append(f"sparseloco.fault_tolerance.lighthouse={lighthouse.address()}")
    try:
        runs = run_distributed(_one_step_worker, p.dp * p.tp * p.pp, path, overrides, timeout_s=600)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    for rank, run in enumerate(runs):
        s = run["summary"]
        assert s["steps"] == 1 and run["moved"] > 0, (rank, s, run["moved"])
        # an untrained model predicts about uniformly over the vocabulary: loss ~ ln V
        assert abs(s["final_train_loss"] - math.log(run["vocab"])) < 0.5, (rank, s["final_train_loss"])
        assert math.isfinite(s["final_val_loss"])
        assert run["compiled"] and all(c == cfg.model.compile for c in run["compiled"]), (rank, run["compiled"])
    assert sorted(q.name for q in (tmp_path / "ckpt").iterdir() if q.name.startswith("step_")) == ["step_1"]
