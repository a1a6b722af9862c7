"""Fixed-length training sequences from the token shards that `prepare` wrote.

A split is cut into non-overlapping windows of `sequence_length + 1` tokens (datatrove's
`DatatroveFolderDataset` does the reading: it already maps a window index to a seek in the right
.ds file). Window w gives input_ids = w[:-1] and label_ids = w[1:].

Training order: every epoch draws a permutation of all windows from (general.seed, epoch); global
micro-batch step j takes the slice [j*mb*dp, (j+1)*mb*dp) of it and replica r its r-th block of mb,
so replicas never share a window and together cover the epoch (less the remainder that does not
fill one step for every replica). The state is (epoch, position), so resuming is exact.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Callable, Dict, Iterator, Mapping, Optional

import numpy as np
import torch

from nanotron_ext.config.schema import Config
from nanotron_ext.data.prepare import MANIFEST, SPLITS, load_tokenizer, read_manifest_file
from nanotron_ext.data.sources import DataError, DataNotPreparedError
from nanotron_ext.fileio import sha256_file, write_text_atomic

_ORDER_STREAM = 2  # SeedSequence tag: the epoch permutations draw from their own stream of general.seed
Batch = Dict[str, torch.Tensor]


# what prepare reads (nanotron_ext.data.prepare): a printed prepare command carries the run's values of these
PREPARE_KEYS = ("data", "tokenizer", "general.seed")


def prepare_command(config: Config, config_file: Optional[str], verify: bool = False) -> str:
    """The `prepare` command that rebuilds `config`'s data: its config file plus a `--set` for every key prepare
    reads whose value differs from the file's own (without them, a run's `--set data.prepared_dir=...` was
    dropped and the printed command rebuilt another folder). Without a config file: data.prepared_dir only."""
    from nanotron_ext.config.loader import config_to_dict, load_config

    words = ["python -m nanotron_ext.data prepare", *(["--verify"] if verify else []),
             "--config-file", shlex.quote(config_file) if config_file else "<your config.yaml>"]
    mine = config_to_dict(config)
    keys = [f"{section}.{k}" for section in PREPARE_KEYS if "." not in section for k in mine.get(section, {})]
    keys += [k for k in PREPARE_KEYS if "." in k]
    try:
        base = config_to_dict(load_config(config_file, [])) if config_file else None
    except Exception:  # noqa: BLE001 - the file alone does not load (a --set made it valid): carry every key
        base = {}

    def value(tree: Dict, key: str) -> object:
        section, name = key.split(".", 1)
        return tree.get(section, {}).get(name, ...)

    for key in keys if base is not None else ["data.prepared_dir"]:
        v = value(mine, key)
        if base is None or value(base, key) != v:
            text = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
            words.append(f"--set {shlex.quote(f'{key}={text}')}")
    return " ".join(words)


def _prepare_hint(config: Config, config_file: Optional[str]) -> str:
    return f"run `{prepare_command(config, config_file)}` first"


def read_manifest(config: Config, config_file: Optional[str] = None) -> dict:
    """The manifest of `data.prepared_dir`, checked against the tokenizer file and `model.vocab_size`."""
    out = Path(config.data.prepared_dir)
    path = out / MANIFEST
    if not path.exists():
        what = "does not exist" if not out.exists() else f"has no {MANIFEST} (not prepared, or prepare was interrupted)"
        raise DataNotPreparedError(f"data.prepared_dir {out} {what}: {_prepare_hint(config, config_file)}")
    manifest = read_manifest_file(out, f"re-run `{prepare_command(config, config_file)}` (it writes the manifest "
                                       "again)")
    tok_path = Path(config.tokenizer.path)
    if not tok_path.exists():
        raise DataNotPreparedError(f"tokenizer.path {tok_path} does not exist but {out} was tokenized with "
                                   f"{manifest['tokenizer']['path']}: {_prepare_hint(config, config_file)}")
    vocab = load_tokenizer(tok_path).get_vocab_size()
    if vocab != manifest["vocab_size"]:
        raise DataError(f"tokenizer {tok_path} has vocab {vocab} but {path} says the shards were made with "
                        f"vocab {manifest['vocab_size']}; re-run prepare into a fresh data.prepared_dir")
    if sha256_file(tok_path) != manifest["tokenizer"]["sha256"]:
        raise DataError(f"tokenizer {tok_path} is not the one {out} was tokenized with (sha256 differs from "
                        f"{path}); re-run prepare into a fresh data.prepared_dir")
    max_id = max(s["max_token_id"] for s in manifest["splits"].values())
    if max_id >= config.model.vocab_size:
        raise DataError(f"{out} holds token id {max_id} but model.vocab_size={config.model.vocab_size}; "
                        f"model.vocab_size must be > {max_id} (tokenizer vocab {manifest['vocab_size']})")
    return manifest


class TokenShardDataset(torch.utils.data.Dataset):
    """Windows of `sequence_length + 1` tokens over the .ds shards of one split; item i -> int64 tensor."""

    def __init__(self, split_dir: str | Path, sequence_length: int, *, token_size: int = 2,
                 expected_tokens: Optional[Dict[str, int]] = None) -> None:
        # datatrove / tokenizers only when preparing or reading data (seconds to import)
        from datatrove.utils.dataset import DatatroveFolderDataset

        self.split_dir = Path(split_dir)
        self.sequence_length = sequence_length
        shards = sorted(self.split_dir.glob("*.ds"))
        if not shards:
            raise DataNotPreparedError(f"no .ds token shards in {self.split_dir}")
        sizes = {p.name: p.stat().st_size // token_size for p in shards}
        for name in sorted(set(sizes) | set(expected_tokens or {})) if expected_tokens is not None else ():
            if sizes.get(name) != expected_tokens.get(name):
                raise DataError(f"shard {self.split_dir / name} does not match the manifest ({sizes.get(name)} "
                                f"tokens on disk, {expected_tokens.get(name)} in the manifest; None = no such "
                                "file): the folder changed after prepare; re-run prepare into a fresh folder")
        self._ds = DatatroveFolderDataset(str(self.split_dir), seq_len=sequence_length, filename_pattern=".ds",
                                          recursive=False, token_size=token_size)
        if len(self._ds) == 0:
            raise DataError(f"{self.split_dir} has {sum(sizes.values())} tokens (largest shard {max(sizes.values())}),"
                            f" fewer than tokens.sequence_length + 1 = {sequence_length + 1}: lower "
                            "tokens.sequence_length or add data")

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range [0, {len(self)})")
        return self._ds[int(index)]["input_ids"]

    def batch(self, indices: np.ndarray) -> Batch:
        windows = torch.stack([self[int(i)] for i in indices])
        return {"input_ids": windows[:, :-1].contiguous(), "label_ids": windows[:, 1:].contiguous()}


def _steps(dataset: TokenShardDataset, micro_batch_size: int, dp_size: int, split: str) -> int:
    steps = len(dataset) // (micro_batch_size * dp_size)
    if steps == 0:
        raise DataError(f"{split} split {dataset.split_dir} has {len(dataset)} sequences of "
                        f"{dataset.sequence_length + 1} tokens, fewer than micro_batch_size {micro_batch_size} x "
                        f"dp {dp_size} = {micro_batch_size * dp_size} needed for one step")
    return steps


class SequenceLoader:
    """Infinite, seeded, resumable micro-batches for one data-parallel replica."""

    def __init__(self, dataset: TokenShardDataset, *, micro_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        self.dataset, self.micro_batch_size, self.seed = dataset, micro_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.steps_per_epoch = _steps(dataset, micro_batch_size, dp_size, "train")
        self.epoch = self.position = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of all windows in `epoch` (identical on every replica)."""
        if epoch != self._perm_epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, _ORDER_STREAM, epoch]))
            self._perm_epoch, self._perm = epoch, rng.permutation(len(self.dataset))
        return self._perm

    def batch_indices(self, epoch: int, position: int) -> np.ndarray:
        """Window indices of this replica's micro-batch `position` in `epoch`."""
        mb = self.micro_batch_size
        start = (position * self.dp_size + self.dp_rank) * mb
        return self.permutation(epoch)[start:start + mb]

    def __iter__(self) -> "SequenceLoader":
        return self

    def __next__(self) -> Batch:
        batch = self.dataset.batch(self.batch_indices(self.epoch, self.position))
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def epochs_for(self, micro_batches: int) -> float:
        """How many times `micro_batches` micro-batches of this replica read the training split."""
        return micro_batches / self.steps_per_epoch

    def epoch_note(self, train_steps: int, accumulation: int) -> Optional[str]:
        """One line for the start of a run that reads its training split more than once (a long run on
        a small corpus, e.g. billions of tokens from the embedded one); None within one epoch."""
        epochs = self.epochs_for(train_steps * accumulation)
        if epochs <= 1:
            return None
        tokens = self.steps_per_epoch * self.micro_batch_size * self.dp_size * self.dataset.sequence_length
        return (f"data: {train_steps:,} steps read the training split ({tokens:,} tokens per epoch, "
                f"{self.dataset.split_dir}) {epochs:,.1f} times; for a long run name a larger corpus in data.paths")

    def state_dict(self) -> Dict[str, int]:
        """Where the next batch comes from, plus what must match to resume (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size, "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        mine = self.state_dict()
        bad = [f"{k} {state[k]} (now {mine[k]})" for k in ("seed", "dp_size", "micro_batch_size", "num_sequences")
               if k in state and state[k] != mine[k]]
        if bad:
            raise DataError(f"cannot resume the data order: the saved loader state has {', '.join(bad)}")
        if not 0 <= state["position"] < self.steps_per_epoch:
            raise DataError(f"saved position {state['position']} is outside [0, {self.steps_per_epoch})")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class ValidationLoader:
    """Deterministic, unshuffled validation micro-batches; every iteration starts from the beginning."""

    def __init__(self, dataset: TokenShardDataset, *, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        self.dataset, self.micro_batch_size, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.steps = _steps(dataset, micro_batch_size, dp_size, "validation")

    def __len__(self) -> int:
        return self.steps

    def batch_indices(self, position: int) -> np.ndarray:
        start = (position * self.dp_size + self.dp_rank) * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for position in range(self.steps):
            yield self.dataset.batch(self.batch_indices(position))


def open_split(config: Config, split: str, *, config_file: Optional[str] = None) -> TokenShardDataset:
    """The checked dataset of one split ('train' or 'validation') at `tokens.sequence_length`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    manifest = read_manifest(config, config_file)
    info = manifest["splits"][split]
    split_dir = Path(config.data.prepared_dir) / split
    if not split_dir.is_dir():
        raise DataNotPreparedError(f"{split_dir} is missing although the manifest lists it: "
                                   f"{_prepare_hint(config, config_file)}")
    dataset = TokenShardDataset(split_dir, config.tokens.sequence_length, token_size=manifest["token_size"],
                                expected_tokens=info["shard_tokens"])  # sizes, always
    _verify_once(split_dir, info.get("shard_sha256", {}), lambda: prepare_command(config, config_file, verify=True))
    return dataset


def _verify_once(split_dir: Path, digests: Dict[str, str], rebuild: Callable[[], str]) -> None:
    """Check the shards' sha256 on their first load. A stamp beside the split records the (size, mtime) of what
    was verified, so later loads only stat; any write to a shard changes its mtime and brings the hash back."""
    stamp = split_dir.with_name(f".verified-{split_dir.name}.json")
    seen = {name: [(split_dir / name).stat().st_size, (split_dir / name).stat().st_mtime_ns] for name in digests}
    try:
        if json.loads(stamp.read_text()) == seen:
            return
    except (OSError, ValueError):
        pass
    for name, digest in sorted(digests.items()):
        if sha256_file(split_dir / name) != digest:
            raise DataError(f"shard {split_dir / name} does not match its sha256 in the manifest (it changed after "
                            f"prepare): rebuild it with `{rebuild()}`")
    try:
        write_text_atomic(stamp, json.dumps(seen))  # ranks may verify at once: unique temp files
    except OSError:
        pass  # a read-only data folder: verify again next time


def build_train_loader(config: Config, *, dp_rank: int = 0, dp_size: Optional[int] = None,
                       config_file: Optional[str] = None) -> SequenceLoader:
    """The training micro-batch iterator of replica `dp_rank` (dp_size defaults to parallelism.dp)."""
    return SequenceLoader(open_split(config, "train", config_file=config_file),
                          micro_batch_size=config.tokens.micro_batch_size, seed=config.general.seed,
                          dp_rank=dp_rank, dp_size=dp_size or config.parallelism.dp)


def build_validation_loader(config: Config, *, dp_rank: int = 0, dp_size: Optional[int] = None,
                            config_file: Optional[str] = None) -> ValidationLoader:
    """The validation micro-batch iterator of replica `dp_rank` (dp_size defaults to parallelism.dp)."""
    return ValidationLoader(open_split(config, "validation", config_file=config_file),
                            micro_batch_size=config.tokens.micro_batch_size, dp_rank=dp_rank,
                            dp_size=dp_size or config.parallelism.dp)
