"""Metrics: FLOPs per token against a hand count, MFU arithmetic, TensorBoard option behaviour."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nanotron_ext.config.schema import LoggingConfig, ModelConfig
from nanotron_ext.metrics.flops import flops_per_token, matmul_weights, mfu
from nanotron_ext.metrics.logger import MetricsLogger, plot_losses, read_metrics


def test_flops_per_token_hand_count() -> None:
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, ffn_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    # per layer: q 64x64, k and v 64x32 each, o 64x64, gate/up 64x128 each, down 128x64; plus head 64x1000
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    matmul = 2 * per_layer + 64 * 1000
    assert flops_per_token(cfg, matmul, seq_len=256) == 6 * matmul + 12 * 2 * 64 * 256


def test_matmul_weights_counts_a_tied_head_once() -> None:
    emb, q, norm = torch.zeros(1000, 64), torch.zeros(64, 64), torch.zeros(64)
    untied = [("token_embedding.pp_block.embedding.weight", emb), ("decoder.0.attn.q.weight", q),
              ("decoder.0.attn.norm.weight", norm), ("lm_head.pp_block.lm_head.weight", emb.clone())]
    tied = untied[:3]  # named_parameters() lists the shared weight under the embedding only
    assert matmul_weights(untied, tied_head=False) == 64 * 64 + 1000 * 64
    assert matmul_weights(tied, tied_head=True) == 64 * 64 + 1000 * 64


def test_mfu_arithmetic() -> None:
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(1000.0, 1e9, 989.0) == pytest.approx(1e12 / 989e12)


def test_metrics_file_and_plot(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, LoggingConfig(progress_bar=False), total_steps=3, start_step=0, is_main=True)
    for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
        log.log({"step": step, "loss": loss, "comm_bytes": {"dp": 8}})
    log.log({"step": 3, "val_loss": 2.2})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("loss") for r in records] == [3.0, 2.5, 2.0, None]
    png = plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_option(tmp_path: Path) -> None:
    cfg = LoggingConfig(progress_bar=False, tensorboard=True)
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(RuntimeError, match=r"pip install -e '\.\[tensorboard\]'"):
            MetricsLogger(tmp_path, cfg, total_steps=1, start_step=0, is_main=True)
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, cfg, total_steps=2, start_step=0, is_main=True)
    log.log({"step": 1, "loss": 1.5, "comm_bytes": {"tp": 4}})
    log.log({"step": 2, "loss": 1.25, "val_loss": 2.0, "comm_bytes": {"tp": 8}})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    read = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert read["loss"] == [(1, 1.5), (2, 1.25)]
    assert read["comm_bytes/tp"] == [(1, 4.0), (2, 8.0)] and read["val_loss"] == [(2, 2.0)]


def test_the_final_progress_line_is_drawn_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The trainer's order at the last step: progress, the validation line, close. The final line used to come
    three times (update, the redraw after the validation line, close: in a log file or a wrapping terminal each
    is a line), the first with the previous step's loss."""
    log = MetricsLogger(tmp_path, LoggingConfig(progress_bar=True), total_steps=3, start_step=0, is_main=True)
    log._bar.mininterval = 0  # draw on every update, as steps seconds apart do
    for loss in (3.0, 2.5, 2.0):
        log.progress(1, loss=loss)
    log.write("step 3: validation loss 1.9")
    log.close()
    out = capsys.readouterr()
    finals = [seg for seg in out.err.replace("\n", "\r").split("\r") if "3/3" in seg]
    assert len(finals) == 1 and "loss=2" in finals[0], finals
    assert out.out == "step 3: validation loss 1.9\n"
