"""One optimiser-free step of a small model, as the distributed tests run it inside `run_distributed` ranks.

The pieces the tests' workers had each written out: the config of a small model through the strict loader
(`small_config`), a fixed batch of token rows and its split into micro-batches (`fixed_rows`, `micro_batches`,
`fixed_micro_batches`), one forward/backward through a pipeline engine with the comm ledger around it
(`one_step`), and every gradient of a rank as its full, unsharded tensor (`full_gradients`).

nanotron_ext is imported inside the functions, as the workers do: a rank builds its model in its own process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config

MicroBatch = Dict[str, torch.Tensor]


def small_config(model: Mapping[str, Any], *, seq: int, mb: int, n_micro: int, dp: int = 1, tp: int = 1,
                 pp: int = 1, parallelism: Optional[Mapping[str, Any]] = None,
                 tokens: Optional[Mapping[str, Any]] = None,
                 tokenizer_vocab: int = 260, **sections: Any) -> "Config":
    """`from_dict(Config, ...)` of a small model: `model` as given, parallelism dp x tp x pp (plus the keys of
    `parallelism`, e.g. pp_engine), a `tokenizer_vocab`-token tokenizer, `seq`-token sequences in `n_micro`
    micro-batches of `mb` (plus the keys of `tokens`), and any other top-level section (optimizer=...,
    sparseloco=...) as given. The loader's errors (ConfigError) propagate."""
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config

    return from_dict(Config, {
        "model": model, "parallelism": {"dp": dp, "tp": tp, "pp": pp, **(parallelism or {})},
        "tokenizer": {"vocab_size": tokenizer_vocab},
        "tokens": {"sequence_length": seq, "micro_batch_size": mb, "batch_accumulation_per_replica": n_micro,
                   **(tokens or {})},
        **sections})


def fixed_rows(n_rows: int, seq: int, vocab: int = 260, seed: int = 7) -> torch.Tensor:
    """`n_rows` rows of `seq + 1` token ids below `vocab`, drawn from a generator seeded with `seed` (the same on
    every rank and in the parent): inputs are a row's first `seq` ids, labels its last `seq`."""
    return torch.randint(0, vocab, (n_rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def micro_batches(rows: torch.Tensor, mb: int, n_micro: Optional[int] = None) -> List[MicroBatch]:
    """Consecutive groups of `mb` rows as {"input_ids", "label_ids"} micro-batches (labels: the inputs shifted by
    one); the first `n_micro` groups, all of them by default."""
    n = rows.shape[0] // mb if n_micro is None else n_micro
    return [{"input_ids": rows[i * mb:(i + 1) * mb, :-1], "label_ids": rows[i * mb:(i + 1) * mb, 1:]} for i in range(n)]


def fixed_micro_batches(n_micro: int, mb: int, seq: int, vocab: int = 260, seed: int = 7) -> List[MicroBatch]:
    """`micro_batches` of `fixed_rows(n_micro * mb, seq, vocab, seed)`."""
    return micro_batches(fixed_rows(n_micro * mb, seq, vocab, seed), mb)


def one_step(model: torch.nn.Module, micro: List[MicroBatch], ctx: Any, engine: Union[str, Any] = "1f1b",
             dp_sync: Any = None) -> Tuple[float, Dict[str, Dict[str, Dict[str, int]]]]:
    """Reset the comm ledger, run `forward_backward` over `micro` on `engine` (a name for `make_engine`, or an
    engine object to reuse), handing the gradients to `dp_sync` (None: the default DP average); return the loss
    (`.item()`) and the ledger's snapshot of that step, {group: {op: {"bytes", "calls"}}}."""
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ledger = get_ledger()
    ledger.reset()
    loss = forward_backward(model, make_engine(engine) if isinstance(engine, str) else engine, micro, ctx, dp_sync)
    return loss.item(), ledger.snapshot()


def full_gradients(model: torch.nn.Module, tp_pg: Any) -> Dict[str, torch.Tensor]:
    """Every gradient on this rank by parameter name, as the full tensor: a TP-sharded one placed into its
    unsharded shape and summed over `tp_pg` (each element lives on exactly one TP rank; every TP rank must call
    this), a replicated one as it is (a copy)."""
    import torch.distributed as torch_dist

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "is_sharded", False) and len(p.get_sharded_info().global_ranks) > 1:
            info = p.get_sharded_info()
            full = torch.zeros(info.unsharded_shape, dtype=g.dtype)
            for pair in info.local_global_slices_pairs:
                full[pair.global_slices] = g[pair.local_slices]
            torch_dist.all_reduce(full, group=tp_pg)
            g = full
        grads[name] = g
    return grads
