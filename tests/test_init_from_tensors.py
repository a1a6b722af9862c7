"""Issue 33 row 5: `model.init_from: hf:DIR` whose model.safetensors is cut short, or holds a tensor of another
shape, or lacks one, is refused when the job starts (nanotron_ext.train.__main__.check_job_start, not at config load:
issue 32) with one line naming the file and the tensor (exit code 2), before any process group; it used to be a
traceback on every rank once the import ran (SafetensorError; "Sizes of tensors must match")."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from tests.helpers.runs import REPO, TINY, VOCAB

pytest.importorskip("transformers")

HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
          tie_word_embeddings=False)
MODEL = ["model.vocab_size=320", "model.hidden_size=32", "model.ffn_size=64", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.max_seq_len=64", "model.tie_embeddings=false", "tokenizer.vocab_size=300",
         "tokens.sequence_length=16"]
K1 = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "hf"))


def _offsets(file: Path) -> Dict[str, Tuple[int, int]]:
    """{tensor: (first byte, end byte)} in the file, read from its header as the safetensors format defines it."""
    with open(file, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    return {k: (8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _run(module: str, args: List[str], init_from: Path) -> subprocess.CompletedProcess:
    sets = [a for s in MODEL + [f"model.init_from=hf:{init_from}"] for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args, "--config-file", str(TINY), *sets], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


def _start(init_from: Path) -> str:
    """The first line the training job prints when it refuses to start (one process: no launcher needed)."""
    got = _run("nanotron_ext.train", [], init_from)
    assert got.returncode == 2, (got.stdout[-500:], got.stderr[-2000:])
    return got.stderr.splitlines()[0]


def test_the_saved_folder_loads(saved: Path) -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.__main__ import check_job_start

    assert _run("nanotron_ext.config", ["show"], saved).returncode == 0
    check_job_start(load_config(TINY, MODEL + [f"model.init_from=hf:{saved}"]))


def test_a_file_cut_short_names_the_tensor_it_cuts(folder: Path) -> None:
    file = folder / "model.safetensors"
    last, (_, end) = max(_offsets(file).items(), key=lambda kv: kv[1][1])
    assert end == file.stat().st_size
    os.truncate(file, end - 1)  # an interrupted copy: the last tensor's last byte is missing
    assert _start(folder) == (f"error: model.init_from: {file} is cut off: tensor {last} ends at byte {end:,}, "
                             f"the file has {end - 1:,} (an interrupted copy or download?)")


def test_a_file_cut_in_its_header_is_one_line(folder: Path) -> None:
    file = folder / "model.safetensors"
    os.truncate(file, 100)
    assert _start(folder) == (f"error: model.init_from: {file} is not a safetensors file, or is cut off in its "
                             "header (100 bytes); copy or download it again")


def _rewrite(file: Path, change: Dict[str, torch.Tensor | None]) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    for name, value in change.items():
        if value is None:
            del state[name]
        else:
            state[name] = value
    save_file(state, str(file), metadata={"format": "pt"})


def test_a_tensor_of_another_shape_is_named_with_both_shapes(folder: Path) -> None:
    file = folder / "model.safetensors"
    _rewrite(file, {K1: torch.zeros(32, 32)})  # the model section's k_proj is num_kv_heads x head_dim = 16 rows
    assert _start(folder) == (f"error: model.init_from: {file}: tensor {K1} has shape [32, 32]; the model "
                             "section gives [16, 32]")


def test_a_missing_tensor_is_named(folder: Path) -> None:
    _rewrite(folder / "model.safetensors", {K1: None})
    assert _start(folder) == f"error: model.init_from: {folder} has no tensor {K1}"


def test_the_launcher_refuses_a_cut_file_with_one_line_before_any_process_group(folder: Path) -> None:
    file = folder / "model.safetensors"
    os.truncate(file, 100)
    got = _run("nanotron_ext.launch", ["--nproc_per_node=2", "-m", "nanotron_ext.train"], folder)
    assert got.returncode == 2
    assert got.stderr.splitlines() == [f"error: model.init_from: {file} is not a safetensors file, or is cut off in "
                                       "its header (100 bytes); copy or download it again"]
