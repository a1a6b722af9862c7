"""The guard decided on the device (general.step_guard: auto with the fused AdamW; nanotron_ext/train/step_guard.py,
issue 40 item 1): nothing is read back to the host between a step's forward and the end of its optimizer step; a
refused step leaves the weights and the optimizer state as they were, and the run stops with the host path's error
naming that step; the metrics and weights of a healthy run are the host path's."""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.test_trainer import TINY, _small_overrides, kill_and_resume

FUSED = ["optimizer.adamw_impl=fused"]  # auto picks it on CUDA only; on CPU it is asked for
HOST = ["general.step_guard=host"]
# what reads a tensor back to the host (a sync on CUDA): patched on torch.Tensor while a step runs
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _where() -> str:
    """The innermost frame outside this file and torch's own: who asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return "?"


def _reads_worker(overrides: list, cuda_sync_check: bool = False) -> dict:
    """Train, recording every read-back from the start of each step's forward (Replica.backward) to the end of
    its train_step (optimizer step, schedule, the weights' norm); with `cuda_sync_check` any CUDA sync there also
    raises (torch.cuda.set_sync_debug_mode)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    state = {"open": False, "steps": 0, "reads": []}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def recording(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            if state["open"]:
                state["reads"].append(f"Tensor.{name} from {_where()}")
            return original(self, *args, **kwargs)
        return read

    backward, train_step = trainer.replica.backward, trainer.train_step

    def opened(micro):  # the marker at the start of the forward
        state["open"], state["steps"] = True, state["steps"] + 1
        if cuda_sync_check:
            torch.cuda.set_sync_debug_mode("error")
        return backward(micro)

    def closed():  # the marker after the optimizer step (and what train_step does after it)
        out = train_step()
        state["open"] = False
        if cuda_sync_check:
            torch.cuda.set_sync_debug_mode("default")
        return out

    trainer.replica.backward, trainer.train_step = opened, closed
    for name in READS:
        setattr(torch.Tensor, name, recording(name))
    try:
        trainer.train()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return {"note": trainer.guard_note, "steps": state["steps"], "reads": state["reads"]}


@pytest.mark.parametrize("dp,tp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                   pytest.param(1, 2, marks=pytest.mark.slow)])
def test_no_read_back_between_the_forward_and_the_optimizer_step(small_corpus: Path, tmp_path: Path, dp: int,
                                                                 tp: int) -> None:
    """Also with the DP gradient all-reduce and TP's clipping all-reduce. (pp > 1 is left out: nanotron's P2P reads
    each message's shape header back, the pipeline's own read, not the guard's.)"""
    base = _small_overrides(small_corpus, tmp_path / "device", dp, tp, 1, 4) + FUSED + ["checkpoints.interval=0"]
    for device in run_distributed(_reads_worker, dp * tp, base):
        assert device["note"].startswith("step guard: on the device"), device["note"]
        assert device["steps"] == 4 and device["reads"] == [], device["reads"]
    if dp * tp > 1:
        return
    # the recorder sees the host path's reads (loss.item(), the gradient norm's float(), the control all-reduce's
    # tolist()): it is not blind
    host = _small_overrides(small_corpus, tmp_path / "host", 1, 1, 1, 2) + FUSED + HOST
    [host] = run_distributed(_reads_worker, 1, host)
    assert host["note"].startswith("step guard: on the host (general.step_guard=host)"), host["note"]
    assert any("Tensor.item from trainer.py" in r for r in host["reads"]), host["reads"]
    assert any("Tensor.__float__ from" in r for r in host["reads"]), host["reads"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync check; the CPU tests above patch Tensor")
def test_no_cuda_sync_between_the_forward_and_the_optimizer_step(small_corpus: Path, tmp_path: Path) -> None:
    """On a device, adamw_impl auto (fused on CUDA): CUDA itself says whether anything synchronised."""
    base = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 4) + ["checkpoints.interval=0"]
    [device] = run_distributed(_reads_worker, 1, base, True)
    assert device["note"].startswith("step guard: on the device"), device["note"]
    assert device["steps"] == 4 and device["reads"] == [], device["reads"]


def _refused_worker(overrides: list, good_steps: int, poison: bool) -> dict:
    """Train `good_steps`, keep the weights and the optimizer state, go on (with `poison` the next step's first
    gradient element NaN, once) until the guard stops the run; what it left."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.errors import TrainingError
    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    if good_steps:
        trainer.train(stop_after=good_steps)
    replica = trainer.replica
    before = {n: p.detach().clone() for n, p in replica.model.named_parameters()}
    opt_before = [{k: v.clone() for k, v in s.items()} for s in replica.optimizer.state.values()]
    backward, poisoned = replica.backward, []

    def nan_once(micro):
        loss = backward(micro)
        if poison and not poisoned:
            next(p for p in replica.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
            poisoned.append(trainer.step + 1)
        return loss

    replica.backward = nan_once
    error = None
    try:
        trainer.train()
    except TrainingError as e:
        error = str(e)
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in replica.model.named_parameters())
    opt_after = [dict(s) for s in replica.optimizer.state.values()]
    opt_unchanged = len(opt_after) == len(opt_before) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(opt_after, opt_before))
    return {"error": error, "step": trainer.step, "note": trainer.guard_note, "unchanged": unchanged,
            "opt_unchanged": opt_unchanged, "weights": {n: p.detach().clone() for n, p in
                                                        replica.model.named_parameters()}}


CASES = {  # name: (extra overrides, good steps first, poison the next step's gradient)
    # a NaN gradient at step 3, read a step late (no validation or checkpoint at 3): step 4 is skipped as well
    "nan_gradient": (["checkpoints.interval=0", "tokens.val_check_interval=0"], 2, True),
    # the same where step 3 is read at once, before its checkpoint (step 2's is set aside, as on the host path)
    "nan_gradient_at_a_checkpoint": (["checkpoints.interval=1", "tokens.val_check_interval=0"], 2, True),
    # lr 10: the first step grows the weights' norm past general.max_weight_growth, judged before step 2
    "weights_grow": (["optimizer.lr=10.0", "checkpoints.interval=0", "tokens.val_check_interval=3"], 0, False),
    # lr 1: the loss climbs past general.max_loss_ratio x the first loss
    "loss_climbs": (["optimizer.lr=1.0", "checkpoints.interval=0", "tokens.val_check_interval=5"], 0, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_step_stops_as_on_the_host_and_leaves_the_weights(small_corpus: Path, tmp_path: Path,
                                                                    case: str) -> None:
    extra, good, poison = CASES[case]

    def run(path: str) -> dict:
        out = tmp_path / path
        ovr = _small_overrides(small_corpus, out, 1, 1, 1, 12) + FUSED + extra + (HOST if path == "host" else [])
        [res] = run_distributed(_refused_worker, 1, ovr, good, poison)
        res["error"] = res["error"] and res["error"].replace(str(out), "<out>")
        return res

    device, host = run("device"), run("host")
    assert device["note"].startswith("step guard: on the device") and host["note"].startswith("step guard: on the host")
    assert device["error"] is not None and device["error"] == host["error"], (device["error"], host["error"])
    bad = int(device["error"].split("step ", 1)[1].split(":")[0])
    assert device["step"] == host["step"], (device["step"], host["step"])
    for name, w in host["weights"].items():  # the refused step (and the one after it) left the weights as they were
        assert torch.equal(device["weights"][name], w), name
    if poison:
        assert device["error"].startswith(f"step {good + 1}: the loss is ") and \
            "and the gradient norm nan (not finite); stopped before the optimizer step, nothing was saved" in \
            device["error"], device["error"]
        assert device["step"] == good and device["unchanged"] and device["opt_unchanged"]
    else:
        assert "training diverged; stopped before the optimizer step, nothing was saved" in device["error"]
        assert device["step"] in (bad, bad - 1)  # a weight check names the step that grew them, a loss check its own


def _metrics_worker(overrides: list) -> dict:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    summary = trainer.train()
    return {"summary": summary, "weights": {n: p.detach().clone() for n, p in
                                            trainer.replica.model.named_parameters()}}


@pytest.mark.slow
def test_the_device_path_logs_the_host_paths_metrics(small_corpus: Path, tmp_path: Path) -> None:
    """Records read a step late carry the same values, in the same key order, as those read at once; the weights
    and checkpoints are the same. Steps 1, 5 are read late, 2, 4, 6 (validation) and 3 (checkpoint) at once."""
    from nanotron_ext.metrics.logger import read_metrics

    timing = {"tokens_per_s", "step_time_s", "peak_memory_bytes", "mfu"}
    runs = {}
    for path in ("device", "host"):
        ovr = _small_overrides(small_corpus, tmp_path / path, 1, 1, 1, 6) + FUSED + ["checkpoints.interval=3"] + \
            (HOST if path == "host" else [])
        [res] = run_distributed(_metrics_worker, 1, ovr)
        records = read_metrics(tmp_path / path / "tiny_llama" / "metrics.jsonl")
        runs[path] = res, [[(k, v) for k, v in r.items() if k not in timing] for r in records]
    (device, device_records), (host, host_records) = runs["device"], runs["host"]
    assert [r[0] for r in device_records] == [("step", s) for s in range(1, 7)]
    assert device_records == host_records
    assert device["summary"]["final_train_loss"] == host["summary"]["final_train_loss"]
    for name, w in host["weights"].items():
        assert torch.equal(device["weights"][name], w), name


def test_only_the_fused_adamw_skips_on_the_device_and_a_skip_leaves_its_state() -> None:
    from nanotron_ext.optim.build import ChainedOptimizer
    from nanotron_ext.optim.skip import host_only, skipped_where

    def params() -> list:
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]

    fused = [torch.optim.AdamW(params(), lr=0.1, fused=True) for _ in range(2)]
    assert host_only(fused[0]) == [] and host_only(ChainedOptimizer(fused)) == []
    assert host_only(torch.optim.AdamW(params(), lr=0.1)) == ["AdamW (not fused)"]
    muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))])
    assert host_only(ChainedOptimizer([muon, fused[0]])) == ["Muon"]

    a, b = params(), params()
    opt_a, opt_b = torch.optim.AdamW(a, lr=0.1, fused=True), torch.optim.AdamW(b, lr=0.1, fused=True)
    for step in range(3):
        for p, q in zip(a, b):
            p.grad = torch.full_like(p, 0.5 + step)
            q.grad = p.grad.clone()
        if step == 1:  # a NaN gradient, refused: nothing moves, the step counts are put back
            a[0].grad[0, 0] = float("nan")
        flag = torch.tensor(float(step == 1))
        kept = ([p.detach().clone() for p in a], {k: v.clone() for k, v in opt_a.state[a[0]].items()})
        with skipped_where(opt_a, flag):
            opt_a.step()
        assert not hasattr(opt_a, "found_inf")
        if step == 1:
            assert all(torch.equal(p, k) for p, k in zip(a, kept[0]))
            assert all(torch.equal(opt_a.state[a[0]][k], v) for k, v in kept[1].items())
        else:  # a flag of 0 is the step without it, bit for bit
            opt_b.step()
            assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert float(opt_a.state[a[0]]["step"]) == 2.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_job_on_the_device_path_resumes_bit_exactly(small_corpus: Path, tmp_path: Path) -> None:
    """test_trainer's kill and resume, at dp = 2 on the device path: the steps read a step late are logged (and
    re-trained after the kill) like the others, every logged loss and the final weights bit for bit."""
    resumed_at = kill_and_resume(small_corpus, tmp_path, 2, 1, 1, "worker", 9,
                                 FUSED + ["checkpoints.interval=3", "tokens.val_check_interval=0"])
    assert 3 <= resumed_at < 9
