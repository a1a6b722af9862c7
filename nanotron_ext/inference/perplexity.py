"""Loss, perplexity and bits per byte of a model on local text, measured the way the trainer measures validation.

The documents are read with the data pipeline's readers (jsonl, parquet, a dataset saved with `save_to_disk`)
and tokenised with the same datatrove DocumentTokenizer `prepare` uses (each document followed by
`<|endoftext|>`), then cut into the trainer's windows of tokens.sequence_length + 1 tokens; the loss is the mean
token cross-entropy of the model's own loss over every window. So on the documents of a run's validation split
(in their order) the loss equals the trainer's validation loss (tests/test_hf_export.py).

Bits per byte compare models across tokenizers: the mean loss per token times the stream's tokens per byte of
UTF-8 text, over ln 2 (the separators are counted as tokens: the model is charged for predicting document ends).
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Dict, Iterator

import numpy as np
import torch
from tqdm import tqdm

from nanotron_ext.config.schema import DataConfig
from nanotron_ext.data.loader import TokenShardDataset
from nanotron_ext.data.prepare import EOS_TOKEN
from nanotron_ext.data.sources import DataError, iter_documents
from nanotron_ext.inference.model import autocast, device


@dataclasses.dataclass
class TextScore:
    documents: int
    bytes: int
    tokens: int
    """Tokens of the whole stream, one separator per document included."""
    windows: int
    scored_tokens: int
    """Tokens predicted: sequence_length per window (a window's first token and the stream's tail are not)."""
    loss: float
    """Mean cross-entropy in nats per scored token."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.loss * self.tokens / self.bytes / math.log(2)

    def as_dict(self) -> Dict[str, float]:
        return {**dataclasses.asdict(self), "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def data_config(path: str, text_key: str = "text", source: str | None = None) -> DataConfig:
    """The DataConfig of one local file or folder; the source follows the name unless given."""
    p = Path(path).expanduser()
    if source is None:
        saved = p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists())
        source = "hf_disk" if saved else "parquet" if p.suffix == ".parquet" else "jsonl"
    return DataConfig(source=source, paths=[str(p)], text_key=text_key)


def _counted(docs: Iterator, totals: Dict[str, int]) -> Iterator:
    for doc in docs:
        totals["documents"] += 1
        totals["bytes"] += len(doc.text.encode("utf-8"))
        yield doc


@torch.no_grad()
def score_text(model: torch.nn.Module, data: DataConfig, tokenizer_json: Path, sequence_length: int,
               batch_size: int, progress: bool = True) -> TextScore:
    """Score `model` (a one-process LlamaForTraining) on the documents of `data` (see the module doc)."""
    from datatrove.pipeline.tokens import DocumentTokenizer

    totals = {"documents": 0, "bytes": 0}
    with tempfile.TemporaryDirectory(prefix="nanotron_ext-eval-") as tmp:
        step = DocumentTokenizer(tmp, str(tokenizer_json), eos_token=EOS_TOKEN, save_filename="eval",
                                 shuffle_documents=False, batch_size=64)
        step.run(_counted(iter_documents(data), totals), rank=0, world_size=1)
        dtype = np.uint16 if step.token_size == 2 else np.uint32
        tokens = sum(np.memmap(f, dtype=dtype, mode="r").size for f in Path(tmp).glob("*.ds") if f.stat().st_size)
        try:
            dataset = TokenShardDataset(tmp, sequence_length, token_size=step.token_size)
        except DataError:
            raise DataError(f"{data.paths[0]} has {tokens} tokens, fewer than one window of tokens.sequence_length + 1 "
                            f"= {sequence_length + 1}") from None
        total, windows = 0.0, len(dataset)
        bar = tqdm(range(0, windows, batch_size), unit="batch", desc="scoring", disable=not progress)
        for start in bar:
            batch = dataset.batch(np.arange(start, min(start + batch_size, windows)))
            with autocast(model):
                loss = model(input_ids=batch["input_ids"].to(device(model)),
                             label_ids=batch["label_ids"].to(device(model)))["loss"]
            total += float(loss) * batch["input_ids"].shape[0]  # equal-length windows: token mean = window mean
    return TextScore(documents=totals["documents"], bytes=totals["bytes"], tokens=int(tokens), windows=windows,
                     scored_tokens=windows * sequence_length, loss=total / windows)
