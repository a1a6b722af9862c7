"""SparseLoCo's byte accounting and utilisation model on numbers worked out by hand; its config checks."""
from __future__ import annotations

import pytest

from nanotron_ext.sparseloco.accounting import (
    collective_time_s,
    compute_utilisation,
    outer_sync_bytes,
    pipeline_utilisation,
    stage_link_bytes,
)
from nanotron_ext.sparseloco.config import SparseLoCoConfig


def test_sync_bytes_by_hand() -> None:
    shapes = [(128, 128), (64,)]
    # (128, 128): 4 tiles of 64 x 64, 32 kept each = 128; (64,): one run of 64, 32 kept -> 160 entries
    # bf16 values 160 * 2 = 320 B, 12-bit indices 160 * 12 / 8 = 240 B
    assert outer_sync_bytes(shapes, SparseLoCoConfig()) == 560
    # fp32 values: 640 + 240; 2-bit codes: 40 B + two 4-entry fp32 tables (32 B)
    assert outer_sync_bytes(shapes, SparseLoCoConfig(value_dtype="fp32")) == 880
    assert outer_sync_bytes(shapes, SparseLoCoConfig(quant_bits=2)) == 240 + 40 + 32


def test_utilisation_by_hand() -> None:
    # 4 replicas, 1 MB payload, 100 Mbit/s: 3 hops of 0.08 s = 0.24 s after 50 steps of 0.5 s
    assert collective_time_s(1e6, 4, 1e8, "all_gather") == pytest.approx(0.24)
    assert compute_utilisation(0.5, 50, 1e6, 4, 1e8) == pytest.approx(25 / 25.24)
    # dense: 400 MB of gradients, 4 replicas, 1 Gbit/s ring all-reduce: 6 hops of 100 MB = 4.8 s per step
    assert compute_utilisation(0.5, 1, 4e8, 4, 1e9, "all_reduce") == pytest.approx(0.5 / 5.3)
    # latency counts once per hop: 1000 B over 8 kbit/s = 1 s + 0.5 s, one hop, after one 1.5 s step
    assert compute_utilisation(1.5, 1, 1000, 2, 8e3, "all_gather", latency_s=0.5) == pytest.approx(0.5)
    assert compute_utilisation(1.0, 1, 1e9, 1, 1.0) == 1.0  # one replica sends nothing
    # the curve of a model's shapes, bytes by the closed forms: 2 replicas, H = 10 steps of 0.5 s
    shapes, cfg = [(128, 128), (64,)], SparseLoCoConfig(inner_steps=10)
    sparse, dense = outer_sync_bytes(shapes, cfg), (128 * 128 + 64) * 4  # dense: every fp32 gradient
    curve = [(b, compute_utilisation(0.5, 10, sparse, 2, b, "all_gather"),
              compute_utilisation(0.5, 1, dense, 2, b, "all_reduce")) for b in (1e3, 1e6)]
    # 560 B over 1 kbit/s: 4.48 s after 5 s of compute; dense 65792 B: 2 hops of 32896 B = 526.336 s
    assert curve[0][1] == pytest.approx(5 / 9.48) and curve[0][2] == pytest.approx(0.5 / 526.836)
    assert curve[1][1] > curve[0][1] and curve[1][2] > curve[0][2]


def test_stage_link_model_by_hand() -> None:
    # 1000 tokens, d = 64 bf16 forward and back: 128 kB each way; k = 8 with an int32 id: 20 kB / 16 kB
    assert stage_link_bytes(1000, 64) == (128_000, 128_000)
    assert stage_link_bytes(1000, 8, id_bytes=4) == (20_000, 16_000)
    # 256 kB over 1 Mbit/s = 2.048 s beside 1 s of compute: blocking 1 / 3.048, overlapped 1 / 2.048
    assert pipeline_utilisation(1.0, 256_000, 1e6) == pytest.approx(1 / 3.048)
    assert pipeline_utilisation(1.0, 256_000, 1e6, overlap=True) == pytest.approx(1 / 2.048)
    assert pipeline_utilisation(3.0, 256_000, 1e6, overlap=True) == 1.0  # transfer hidden
    # H = 10 such steps and a 4 s sync: 10 / (10 * 3.048 + 4)
    assert pipeline_utilisation(1.0, 256_000, 1e6, inner_steps=10, sync_s=4.0) == pytest.approx(10 / 34.48)


@pytest.mark.parametrize("kwargs,key", [({"chunk": 1000}, "sparseloco.chunk"), ({"topk": 0}, "sparseloco.topk"),
                                        ({"index_bits": 11}, "sparseloco.index_bits"),
                                        ({"beta": 1.5}, "sparseloco.beta"),
                                        ({"quant_bits": 9}, "sparseloco.quant_bits")])
def test_config_rejects_values_naming_the_key(kwargs: dict, key: str) -> None:
    from nanotron_ext.config.schema import ConfigError

    with pytest.raises(ConfigError, match=key):
        SparseLoCoConfig(**kwargs)


def test_paper_configs_are_current() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "reproduce" / "het_sparseloco" / "make_configs.py"
    assert subprocess.run([sys.executable, str(script), "--check"], capture_output=True).returncode == 0
