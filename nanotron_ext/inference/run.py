"""A finished (or running) training run as something to read: its config, a checkpoint, the full tensors.

`open_run(runs/<run>)` finds the checkpoint (the newest complete one, or `step`) and the config its weights were
trained with (the copy in the checkpoint's meta.json, else the run's config.yaml). `gather` reassembles the
checkpoint's shards: a checkpoint holds one file per rank and nanotron's ShardedInfo on each parameter of the
model built for that rank says which slice the file holds, so the run's layout (tp x pp, one DP replica) is
spawned as gloo CPU processes that build their model, load their file and sum their slices into full tensors over
TP; each stage's TP rank 0 writes them to a temporary folder this process reads. A one-process layout runs its
rank in this process instead (when it has no process group of its own). Any TP strategy and technique
works, because nothing here knows a layout: the model built per rank does.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed as torch_dist

from nanotron_ext.config.loader import config_to_dict, from_dict, load_config
from nanotron_ext.config.schema import Config
from nanotron_ext.errors import UserFacingError
from nanotron_ext.fileio import sha256_file
from nanotron_ext.train.checkpoint_store import CheckpointError, list_checkpoints, read_meta, saved_config

T = TypeVar("T")
Folders = Union[str, Path, Sequence[Union[str, Path]], None]  # one checkpoint folder, or every host's


class RunError(UserFacingError, ValueError):
    """A run folder, checkpoint or file that cannot be used; the message names it and what to do."""


@dataclasses.dataclass
class RunCheckpoint:
    run_dir: Path
    config: Config
    """The run's configuration as its checkpoint was trained with (model.init_from cleared: weights come from here)."""
    path: Path
    """The checkpoint folder step_<N>."""
    step: int
    meta: Dict[str, Any]
    folders: List[Path] = dataclasses.field(default_factory=list)
    """Every folder holding this step's shards: `path`, and with checkpoints.storage=per_host the other hosts'."""

    def shard_files(self, replica: int) -> Dict[str, Tuple[Path, Dict[str, Any]]]:
        """Each shard of DP replica `replica`: the file (in the first of `folders` that has it) and its meta entry
        (name, bytes, sha256). A shard in none of them is a RunError naming the host that wrote it."""
        hosts = self.meta.get("hosts") or {"0": self.meta["files"]}
        folders = self.folders or [self.path]
        out: Dict[str, Tuple[Path, Dict[str, Any]]] = {}
        for host, entries in sorted(hosts.items()):
            for entry in entries:
                if entry["dp"] != replica:
                    continue
                where = next((f / entry["name"] for f in folders if (f / entry["name"]).is_file()), None)
                if where is None:
                    given = ", ".join(map(str, folders))
                    raise RunError(f"step_{self.step} is incomplete here: node {host}'s shard {entry['name']} is in "
                                   f"none of {given} (checkpoints.storage=per_host: each host kept its own); pass "
                                   "every host's checkpoints.dir with --checkpoints DIR [DIR ...], or copy node "
                                   f"{host}'s files into one of them")
                out[entry["name"]] = (where, entry)
        return out

    @property
    def layout(self) -> Dict[str, int]:
        return {k: int(self.meta["layout"][k]) for k in ("dp", "tp", "pp")}

    def tokenizer_path(self, override: Optional[str] = None) -> Path:
        """The tokenizer file of the run (or `override`, --tokenizer), checked to load: before any work, and a
        damaged one is one line naming it (eval's was a traceback after the model was gathered)."""
        from nanotron_ext.data.prepare import load_tokenizer

        path = Path(override or self.config.tokenizer.path).expanduser()
        flag = "--tokenizer" if override else f"tokenizer.path of {self.run_dir}"
        if path.exists() and not path.is_file():
            raise RunError(f"tokenizer {path} ({flag}) is not a file (a folder?); give the tokenizer JSON, e.g. "
                           f"{path / 'tokenizer.json'}")
        if not path.is_file():
            raise RunError(f"tokenizer {path} (--tokenizer) does not exist" if override else
                           f"tokenizer {path} (tokenizer.path of {self.run_dir}) does not exist here: "
                           "run from the folder you trained in, or pass --tokenizer PATH")
        load_tokenizer(path, flag)
        return path


def _without_init_from(config: Dict[str, Any]) -> Dict[str, Any]:
    out = {**config, "model": dict(config.get("model", {}))}
    out["model"].pop("init_from", None)  # the checkpoint holds the weights; the source folder may be gone
    return out


class CheckpointGone(RunError):
    """The checkpoint being read was deleted meanwhile (a live run's checkpoints.keep_last pruned it)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"checkpoint {path} was deleted while it was read")
        self.path = path


def read_live(run: str | Path, step: Optional[int], checkpoints: Folders,
              read: Callable[[RunCheckpoint], T]) -> Tuple[RunCheckpoint, T]:
    """open_run, then `read` the checkpoint (gather it): a run still training deletes its older checkpoints
    (checkpoints.keep_last), which made eval and generate fail with a bare "[Errno 2] No such file". A checkpoint
    that disappears while it is read is said, and the newest one read instead, once; with an explicit `step`
    (--step) the message says why and what to do instead."""
    gone: List[Path] = []
    while True:
        ckpt: Optional[RunCheckpoint] = None
        try:
            ckpt = open_run(run, step, checkpoints)
            return ckpt, read(ckpt)
        except (UserFacingError, OSError) as e:
            path = e.path if isinstance(e, CheckpointGone) else (ckpt.path if ckpt is not None else None)
            if path is None or path.exists():
                raise
            keep = ckpt.config.checkpoints.keep_last if ckpt is not None else None
            why = (f"checkpoint {path} was deleted while it was read: the run is still training and removes its "
                   f"older checkpoints (checkpoints.keep_last{'=' + str(keep) if keep is not None else ''})")
            if step is not None:
                raise RunError(f"{why}; choose a newer --step, or leave --step out to read the newest") from None
            if gone:
                raise RunError(f"{why}, as was {gone[0]} before it; read the run again, or when it ends") from None
            gone.append(path)
            print(f"{why}; reading the newest checkpoint instead", file=sys.stderr, flush=True)


def open_run(run: str | Path, step: Optional[int] = None, checkpoints: Folders = None) -> RunCheckpoint:
    """The run at `run` (general.output_dir/general.run) and its checkpoint `step` (default: the newest complete).
    `checkpoints`: its checkpoint folder (default checkpoints.dir of the run), or with checkpoints.storage=per_host
    every host's (the newest step complete in all of them, by default)."""
    run_dir = Path(run).expanduser()
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise RunError(f"{run_dir} is not a run folder (no config.yaml): pass runs/<run>, the folder a training run "
                       "writes its metrics and config to")
    config = load_config(config_file, ["model.init_from=null"])
    roots = [Path(c).expanduser() for c in ([checkpoints] if isinstance(checkpoints, (str, Path)) else
                                            checkpoints or [])]
    if len(roots) > 1:
        step = _common_step(roots, step)
    checkpoints = str(roots[0]) if roots else None
    root = Path(checkpoints or config.checkpoints.dir).expanduser()
    skipped: List[Tuple[int, Path, str]] = []  # damaged step folders: said in this command's one line
    found = list_checkpoints(root, skipped)
    damaged = {s: (p, why) for s, p, why in skipped}
    if not found:
        hint = " (a relative path: run from the folder you trained in, or pass --checkpoints DIR)" \
            if not Path(config.checkpoints.dir).is_absolute() and not checkpoints else ""
        if checkpoints and list_checkpoints(root.parent, []) and (root / "meta.json").is_file():
            hint = (f" ({root.name} is one checkpoint: pass its folder, --checkpoints {root.parent}, "
                    "and --step to choose)")
        if skipped:
            s, p, why = max(skipped)
            hint += f"; {p.name} is damaged ({why})"
        given = f"--checkpoints {root}" if checkpoints else f"checkpoints.dir of {config_file}"
        raise RunError(f"no complete checkpoint in {root} ({given}){hint}")
    steps = {s: p for s, p in found}
    if step is None:
        step = found[-1][0]
        newer = [s for s in damaged if s > step]
        if newer:  # (a note, not an error: the newest complete checkpoint is read)
            print(f"note: {damaged[max(newer)][0]} is damaged ({damaged[max(newer)][1]}); reading step {step}",
                  file=sys.stderr, flush=True)
    elif step in damaged:
        raise RunError(f"{damaged[step][0]} is damaged ({damaged[step][1]}); choose another --step of "
                       f"{sorted(steps)}")
    elif step not in steps:
        raise RunError(f"{root} has no complete checkpoint of step {step}; it has steps {sorted(steps)}")
    try:
        meta = read_meta(steps[step])
        saved = saved_config(steps[step])
    except CheckpointError:
        if not steps[step].exists():  # deleted since it was listed
            raise CheckpointGone(steps[step]) from None
        raise
    if saved:
        config = from_dict(Config, _without_init_from(saved))
    folders = [steps[step]] + [r / f"step_{step}" for r in roots[1:]]
    return RunCheckpoint(run_dir, config, steps[step], step, meta, folders)


def _common_step(roots: List[Path], step: Optional[int]) -> int:
    """The step to read from several hosts' checkpoint folders: `step`, complete in each, or the newest complete
    in all; a folder without it is a RunError naming the folder."""
    have = {r: {s for s, _ in list_checkpoints(r, [])} for r in roots}
    if step is None:
        common = set.intersection(*have.values())
        if not common:
            listing = "; ".join(f"{r}: {sorted(s) or 'none'}" for r, s in have.items())
            raise RunError(f"no step is complete in every --checkpoints folder ({listing})")
        return max(common)
    lacking = [r for r, s in have.items() if step not in s]
    if lacking:
        raise RunError(f"{lacking[0]} has no complete checkpoint of step {step}; it has steps "
                       f"{sorted(have[lacking[0]])}")
    return step


@dataclasses.dataclass
class Gathered:
    raw: Dict[str, torch.Tensor]
    """Every parameter as its full tensor and every persistent buffer, under our layout-independent names."""
    dense: Optional[Dict[str, torch.Tensor]]
    """The standard layout (nanotron_ext.models.dense), when asked for and the model has one."""
    refusal: Optional[str]
    """Why there is no dense equivalent (one line), when asked for and there is none."""
    logits: Optional[torch.Tensor]
    """Logits [1, s, V] of `check_ids`, computed in the run's own layout, when asked for."""


def gather(ckpt: RunCheckpoint, *, replica: int = 0, dense: bool = False,
           check_ids: Optional[torch.Tensor] = None) -> Gathered:
    """Reassemble DP replica `replica` of `ckpt` (see the module doc); with `dense`, also its dense equivalent; with
    `check_ids` [1, s], also the logits the run's layout computes for them."""
    layout = ckpt.layout
    if not 0 <= replica < layout["dp"]:
        raise RunError(f"--replica {replica}: the run has parallelism.dp={layout['dp']} replicas "
                       f"(0..{layout['dp'] - 1})")
    world = layout["tp"] * layout["pp"]
    with tempfile.TemporaryDirectory(prefix="nanotron_ext-gather-") as tmp:
        shards = {name: (str(file), entry) for name, (file, entry) in ckpt.shard_files(replica).items()}
        job = {"config": config_to_dict(ckpt.config), "shards": shards, "replica": replica,
               "dense": dense, "check_ids": check_ids, "out": tmp, "tp": layout["tp"], "pp": layout["pp"]}
        try:
            if world == 1 and not torch_dist.is_initialized():
                _gather_here(job)  # a fresh interpreter re-imports torch and the package: ~4 s of a 10 s eval
            else:
                torch.multiprocessing.spawn(_worker, args=(world, job), nprocs=world, join=True)
        except Exception:  # the failing rank wrote a user-facing reason first, when it had one
            if not ckpt.path.exists():  # pruned meanwhile by the live run (read_live says so)
                raise CheckpointGone(ckpt.path) from None
            reasons = sorted(Path(tmp).glob("error_*.txt"))
            if reasons:
                raise RunError(reasons[0].read_text()) from None
            raise
        stages = range(layout["pp"])
        raw: Dict[str, torch.Tensor] = {}
        for s in stages:
            raw.update(torch.load(Path(tmp) / f"raw_pp{s}.pt", weights_only=True))
        out = Gathered(raw=raw, dense=None, refusal=None, logits=None)
        if dense:
            refusals = [p.read_text() for s in stages if (p := Path(tmp) / f"refusal_pp{s}.txt").exists()]
            if refusals:
                out.refusal = refusals[0]
            else:
                out.dense = {}
                for s in stages:
                    out.dense.update(torch.load(Path(tmp) / f"dense_pp{s}.pt", weights_only=True))
        if check_ids is not None:
            out.logits = torch.load(Path(tmp) / "logits.pt", weights_only=True)
        return out


def _read_shard(shards: Dict[str, Tuple[str, Dict[str, Any]]], name: str) -> Dict[str, Any]:
    if name not in shards:
        raise RunError(f"the checkpoint's meta.json lists no file {name}")
    file, entry = Path(shards[name][0]), shards[name][1]
    if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
        raise RunError(f"{file} does not match its size/sha256 in meta.json (damaged?); use another --step")
    return torch.load(file, map_location="cpu", weights_only=True)


def _gather_here(job: Dict[str, Any]) -> None:
    """A one-process layout's rank in this process, leaving nothing of it behind: its world of one, the rank
    variables, the random state building the model draws from, the logging level."""
    from nanotron_ext.parallel.context import lone_rank_env

    level = logging.root.manager.disable
    try:
        with lone_rank_env(), torch.random.fork_rng(devices=[]):
            _worker(0, 1, job, threads=False)
    finally:
        logging.disable(level)


def _worker(rank: int, world: int, job: Dict[str, Any], threads: bool = True) -> None:
    from nanotron_ext.parallel.context import init_portless, release_process_groups

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if threads:  # a spawned rank's share of the cores (this process keeps its own setting)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.disable(logging.WARNING)  # build-time notes (fallbacks, grouping) were shown when the run trained
    out = Path(job["out"])
    try:
        init_portless("gloo", rank, world, store_file=str(out / "store"))
        _gather_rank(job, out)
    except UserFacingError as e:
        (out / f"error_{rank}.txt").write_text(str(e))
        raise
    finally:
        release_process_groups()  # in this process (a one-process layout), its gloo threads end here


def _gather_rank(job: Dict[str, Any], out: Path) -> None:
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    from nanotron_ext.models.build import build_model, replica_config
    from nanotron_ext.models.dense import NoDenseEquivalent, dense_state_dict, full_tensor
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.agreement import gather_or_raise

    cfg = replica_config(from_dict(Config, job["config"]), job["replica"])
    ctx = build_parallel_context(1, job["tp"], job["pp"], backend="gloo")
    model = build_model(cfg, ctx)
    pp_rank, _, tp_rank = (int(r) for r in ctx.get_3d_ranks(torch_dist.get_rank()))
    name = f"pp{pp_rank}_dp{job['replica']}_tp{tp_rank}.pt"
    error: Optional[str] = None
    try:
        model.load_state_dict(_read_shard(job["shards"], name)["model"])
    except (RunError, OSError, RuntimeError) as e:  # every rank learns, so none waits in a collective below
        error = f"{job['shards'].get(name, (name,))[0]}: {e}"
    gather_or_raise(error, None, lambda failed: RunError(failed[0][1]))

    raw = {n: full_tensor(p, ctx.tp_pg) for n, p in model.named_parameters()}
    persistent = set(model.state_dict())
    raw.update({n: b.detach().cpu().clone() for n, b in model.named_buffers(remove_duplicate=False) if n in persistent})
    dense = refusal = None
    if job["dense"]:
        try:
            dense = dense_state_dict(model, ctx.tp_pg)
        except NoDenseEquivalent as e:  # the same module on every TP rank of this stage: no collective is left open
            refusal = str(e)
    logits = None
    if job["check_ids"] is not None:
        with torch.no_grad():
            ids = job["check_ids"] if pp_rank == 0 else TensorPointer(group_rank=0)
            sharded = model.sharded_logits(ids)
        if pp_rank == job["pp"] - 1:
            shards = [torch.empty_like(sharded) for _ in range(job["tp"])]
            torch_dist.all_gather(shards, sharded.contiguous(), group=ctx.tp_pg)
            logits = torch.cat(shards, dim=-1)
    if tp_rank == 0:
        torch.save(raw, out / f"raw_pp{pp_rank}.pt")
        if dense is not None:
            torch.save(dense, out / f"dense_pp{pp_rank}.pt")
        if refusal is not None:
            (out / f"refusal_pp{pp_rank}.txt").write_text(refusal)
        if logits is not None:
            torch.save(logits, out / "logits.pt")
