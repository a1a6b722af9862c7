"""What a technique declares so the core names none of its keys (nanotron_ext.technique.Technique): the keys that
define a resume (`resume_keys`, by default its sections; `resume_free`), the widths that scale with d (`widths`), and
the overrides that make the uncompressed twin (`uncompressed`). The core reads them from every registered technique:
MAPL's `optimizer.spel.mode` and the toy's `toy_sync.every` (a package outside the repository) are refused across a
resume by name, though the core's resume check names neither."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from tests.helpers.runs import REPO

TINY = "examples/config_tiny_llama.yaml"
TOY = REPO / "tests" / "toy_technique"


def _config(overrides: List[str]) -> Dict[str, Any]:
    from nanotron_ext.config.loader import config_to_dict, load_config

    return config_to_dict(load_config(REPO / TINY, overrides))


def _saved_with(folder: Path, config: Dict[str, Any]) -> Path:
    """A checkpoint folder whose meta.json records `config` (all the resume check reads)."""
    ckpt = folder / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "config": config}))
    return ckpt


def test_changing_mapl_spel_mode_across_a_resume_is_refused_by_name(tmp_path: Path) -> None:
    """optimizer.spel is MAPL's section: the core's resume check used to compare model.* and sparseloco.* only, so
    the manifold SPEL steps on changed silently. Its step size is free, like the core's optimizer.lr."""
    from nanotron_ext.train.guard import resume_conflict

    ckpt = _saved_with(tmp_path, _config(["optimizer.spel.mode=stiefel", "optimizer.spel.lr_scale=0.1"]))
    refused = resume_conflict(ckpt, _config(["optimizer.spel.mode=euclidean", "optimizer.spel.lr_scale=0.1"]))
    assert refused is not None and "optimizer.spel.mode 'stiefel' -> 'euclidean'" in refused, refused
    assert "lr_scale" not in refused
    assert resume_conflict(ckpt, _config(["optimizer.spel.mode=stiefel", "optimizer.spel.lr_scale=0.2"])) is None


def test_the_in_tree_declarations_keep_the_resume_rules_and_the_twin() -> None:
    """SparseLoCo's fault-tolerance rendezvous stays free across a resume and its other keys do not; the uncompressed
    twin is the core's three plain pieces plus SparseLoCo's full-model replicas, as before the declarations."""
    from nanotron_ext.models.param_count import uncompressed_overrides
    from nanotron_ext.train.guard import changed_keys

    saved = {"sparseloco": {"inner_steps": 4, "fault_tolerance": {"timeout_s": 30.0, "replica": 0}}}
    now = {"sparseloco": {"inner_steps": 8, "fault_tolerance": {"timeout_s": 60.0, "replica": 1}}}
    assert changed_keys(saved, now) == ["sparseloco.fault_tolerance.replica 0 -> 1", "sparseloco.inner_steps 4 -> 8"]
    assert uncompressed_overrides() == ["model.codec.kind=identity", "model.embedding.kind=standard",
                                        "model.output_constraint.kind=none", "sparseloco.compressed_replicas=[]"]


TOY_SCRIPT = '''
import json, sys
from pathlib import Path
from nanotron_ext.bench.clock import twin_overrides
from nanotron_ext.config.loader import config_to_dict, load_config
from nanotron_ext.models.param_count import uncompressed_overrides
from nanotron_ext.train.guard import resume_conflict

tiny, ckpt, wide = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
ckpt.mkdir(parents=True)
saved = config_to_dict(load_config(tiny, ["toy_sync.every=2"]))
(ckpt / "meta.json").write_text(json.dumps({"step": 4, "config": saved}))
twin = load_config(tiny, ["model.codec.kind=toy_trunc", "model.codec.boundaries=every_layer", "toy_sync.every=3",
                          *uncompressed_overrides()])
print(json.dumps({"refused": resume_conflict(ckpt, config_to_dict(load_config(tiny, ["toy_sync.every=3"]))),
                  "same": resume_conflict(ckpt, saved), "overrides": uncompressed_overrides(),
                  "twin": [twin.model.codec.kind, twin.toy_sync.every],
                  "scaled": twin_overrides(tiny, ["model.codec.kind=toy_trunc", "model.codec.boundaries=every_layer",
                                                  "model.codec.toy.width=8"], wide)}))
'''


def _run_with_the_toy(script: str, *args: str) -> Dict[str, Any]:
    """`script`'s JSON output in a process whose registry holds the toy technique (tests/toy_technique/, found through
    its entry point; this pytest process never registers it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOY), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_toy_declares_its_resume_keys_widths_and_uncompressed_twin(tmp_path: Path) -> None:
    """The toy (outside the repository) changes toy_sync.every across a resume: refused, naming the key; its
    `uncompressed` override joins the core's in the twin, which syncs every step with the identity codec; the model
    clock's twin at twice the hidden size (128 -> 256) doubles its declared width (8 -> 16)."""
    text = (REPO / TINY).read_text()
    assert text.count("hidden_size: 128") == 1
    wide = tmp_path / "wide.yaml"
    wide.write_text(text.replace("hidden_size: 128", "hidden_size: 256"))
    got = _run_with_the_toy(TOY_SCRIPT, str(REPO / TINY), str(tmp_path / "step_4"), str(wide))
    assert got["refused"] is not None and "toy_sync.every 2 -> 3" in got["refused"], got
    assert got["same"] is None
    assert got["overrides"][-1] == "toy_sync.every=1" and "sparseloco.compressed_replicas=[]" in got["overrides"]
    assert got["twin"] == ["identity", 1]
    assert "model.codec.toy.width=16" in got["scaled"] and "model.hidden_size=256" in got["scaled"], got["scaled"]
