"""The rank analysis (nanotron_ext.subspace.analyse) on closed forms, and its CLI end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotron_ext.codecs.energy import energy_kept
from nanotron_ext.subspace.analyse import best_basis, stable_rank


def test_stable_rank_closed_forms() -> None:
    assert stable_rank(torch.diag(torch.tensor([3.0, 1.0, 1.0]))) == pytest.approx(11 / 9)
    assert stable_rank(torch.outer(torch.randn(7), torch.randn(5))) == pytest.approx(1.0)
    q = torch.linalg.qr(torch.randn(6, 6))[0]
    assert stable_rank(q) == pytest.approx(6.0)
    assert stable_rank(torch.zeros(3, 3)) == 0.0


def test_energy_kept_closed_forms() -> None:
    u = torch.linalg.qr(torch.randn(8, 3, generator=torch.Generator().manual_seed(0)))[0]
    inside = torch.randn(10, 3) @ u.T
    assert energy_kept(inside, u) == pytest.approx(1.0)
    v = torch.randn(8)
    v = v - u @ (u.T @ v)  # orthogonal to span(U)
    assert energy_kept(v[None, :], u) == pytest.approx(0.0, abs=1e-12)
    x = 3 * u[:, 0] / u[:, 0].norm() + 4 * v / v.norm()  # energy 9 inside, 16 outside
    assert energy_kept(x[None, :], u) == pytest.approx(9 / 25)
    diag = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    assert energy_kept(diag, best_basis(diag, 2)) == pytest.approx((16 + 9) / 30)


@pytest.mark.slow
def test_cli_writes_table_json_and_png(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    # pp = 1: the split embedding and the constraint without the codec (it would have no boundary to act on)
    sets = ["model.tie_embeddings=false", "model.embedding.kind=subspace",
            "model.output_constraint.kind=subspace", "model.subspace.k=16", "model.num_layers=2",
            "tokens.micro_batch_size=2", "tokens.sequence_length=16"]
    cmd = [sys.executable, "-m", "nanotron_ext.subspace.analyse", "--config-file",
           str(root / "examples/config_tiny_llama.yaml"),
           "--random-tokens", "--batches", "1", "--out", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "MASTER_PORT": str(__import__("tests.helpers.dist", fromlist=["free_port"]).free_port())}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "analysis.json").read_text())["rows"]
    assert [r["layer"] for r in rows] == [0, 1]
    assert rows[1]["energy_kept_by_U"] == pytest.approx(1.0, abs=1e-6)  # constrained: all energy in span(U)
    assert (tmp_path / "analysis.png").stat().st_size > 1000
    assert "energy_kept_by_U" in out.stdout
