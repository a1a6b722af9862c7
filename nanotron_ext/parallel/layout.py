"""The parallel layout as plain numbers (no torch, no process group): checks of a dp x tp x pp grid
against the model's shapes, which stage holds each decoder layer, where the codec boundaries sit, and
link stage pairs. The config layer validates with these at load; the model builder places layers with
the same functions, so what loads is what runs."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Set, Tuple, Union


class ParallelismError(ValueError):
    """A parallel layout that cannot run; raised before any process group exists."""


def validate_parallelism(
    world_size: int,
    dp: int,
    tp: int,
    pp: int,
    *,
    num_layers: Optional[int] = None,
    hidden_size: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    ffn_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> None:
    """Check a layout against the world size and the model's shapes, naming the offending values."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise ParallelismError(f"parallelism.{name} must be >= 1, got {value}")
    if dp * tp * pp != world_size:
        raise ParallelismError(
            f"world size {world_size} != parallelism.dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp}"
        )
    if num_layers is not None and num_layers < pp:
        raise ParallelismError(f"model.num_layers={num_layers} is fewer than pipeline stages parallelism.pp={pp}")
    for key, value in (
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("ffn_size", ffn_size),
        ("vocab_size", vocab_size),
    ):
        if value is not None and value % tp != 0:
            raise ParallelismError(f"model.{key}={value} is not divisible by parallelism.tp={tp}")


def split_layers(num_layers: int, pp: int, layers_per_stage: Optional[List[int]] = None) -> List[int]:
    """Stage index of each decoder layer; as even as possible, earlier stages take the remainder."""
    counts = layers_per_stage or [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
    return [stage for stage, n in enumerate(counts) for _ in range(n)]


def codec_boundaries(spec: Union[str, List[int]], stage_of_layer: List[int]) -> List[int]:
    """Sending-layer indices of the codec boundaries for `model.codec.boundaries`."""
    last = len(stage_of_layer) - 1
    if spec == "stages":
        return [i for i in range(last) if stage_of_layer[i] != stage_of_layer[i + 1]]
    if spec == "every_layer":
        return list(range(last))
    return sorted(spec)


@dataclasses.dataclass
class Boundaries:
    """Where a model's pipeline boundaries sit, each named by its sending layer (layer i encodes boundary i, layer
    i + 1 decodes it): what LlamaForTraining builds per layer and AccountedP2P sends (parallel/p2p.py)."""

    codec_after: Set[int]
    """The codec's boundaries (model.codec.boundaries): these layers encode, the next ones decode."""
    wire_after: Set[int]
    """Every layer that emits a wire: the codec's and every stage end, one tensor per boundary (codecs/base.py); a
    stage end outside model.codec.boundaries sends the plain hidden state (identity codec)."""
    replicated_wires: Set[int]
    """Stages whose outgoing pipeline wire is the same on every TP rank (AccountedP2P.scatter_gather)."""
    carry_ids: bool
    """Whether the token ids ride along with the hidden state to the codec (a codec that needs them)."""


def place_boundaries(spec: Union[str, List[int]], stage_of_layer: List[int], *, residual_sharded: bool,
                     codec_replicated: bool, needs_token_ids: bool) -> Boundaries:
    """The boundaries of a model whose layers sit on `stage_of_layer`, for `model.codec.boundaries` = `spec`; the
    codec's wire is replicated over TP or not (`BoundaryCodec.wire_replicated`), the plain one follows the residual
    stream (sharded under btp)."""
    codec_after = set(codec_boundaries(spec, stage_of_layer))
    stage_ends = set(codec_boundaries("stages", stage_of_layer))
    replicated = {stage_of_layer[i] for i in stage_ends
                  if (codec_replicated if i in codec_after else not residual_sharded)}
    return Boundaries(codec_after, codec_after | stage_ends, replicated, needs_token_ids and bool(codec_after))


def stage_pair(key: str) -> Tuple[int, int]:
    """(a, b) of a link key "a-b" between neighbouring pipeline stages (pipeline messages only cross
    neighbours: any other pair would never carry a byte)."""
    parts = key.split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ParallelismError(f"{key!r}: keys look like '0-1' (two stage indices >= 0)")
    a, b = int(parts[0]), int(parts[1])
    if abs(a - b) != 1:
        raise ParallelismError(f"{key!r}: pipeline messages only cross neighbouring stages; "
                               f"use '{min(a, b)}-{min(a, b) + 1}'" if a != b else
                               f"{key!r}: a stage has no link to itself")
    return a, b
