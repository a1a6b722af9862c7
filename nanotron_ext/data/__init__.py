"""Data: `python -m nanotron_ext.data prepare` builds token shards; the loaders feed the trainer."""
from nanotron_ext.data.loader import (  # noqa: F401
    SequenceLoader,
    TokenShardDataset,
    ValidationLoader,
    build_train_loader,
    build_validation_loader,
    open_split,
    read_manifest,
)
from nanotron_ext.data.prepare import EOS_TOKEN, PrepareReport, prepare, train_tokenizer  # noqa: F401
from nanotron_ext.data.sources import DataError, DataNotPreparedError, iter_documents  # noqa: F401

__all__ = [
    "DataError", "DataNotPreparedError", "EOS_TOKEN", "PrepareReport", "SequenceLoader", "TokenShardDataset",
    "ValidationLoader", "build_train_loader", "build_validation_loader", "iter_documents", "open_split", "prepare",
    "read_manifest", "train_tokenizer",
]
