"""Small references the tests compute expectations with, built on the package's own pieces. Each was a public
function of nanotron_ext that only tests called (issue 55): a reference lives beside its tests."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanotron_ext.sparseloco.compress import ChunkSpec


def scalar_map(s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """What `steps` Polar Express iterations do to normalised singular values `s` (the scalar composition of
    nanotron_ext.optim.polar_express.step_coefficients): polar_express(X) = U diag(scalar_map(s)) V^T."""
    from nanotron_ext.optim.polar_express import step_coefficients

    for a, b, c in step_coefficients(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def densify(indices: torch.Tensor, values: torch.Tensor, spec: "ChunkSpec") -> torch.Tensor:
    """Sparse chunks (SparseLoCo's top-k indices and values per chunk) -> a dense tensor of `spec.shape`, zeros where
    nothing was sent."""
    from nanotron_ext.sparseloco.compress import from_chunks

    dense = torch.zeros(spec.n_chunks, spec.chunk_size, dtype=torch.float32, device=values.device)
    dense.scatter_(1, indices, values.reshape(indices.shape).float())
    return from_chunks(dense, spec)


@torch.no_grad()
def adapt_(emb: "torch.nn.Module") -> None:
    """Heterogeneous SparseLoCo's embedding adaptation (eq. 3-4) on every row of one replica's table, by the fold the
    outer loop applies to the rows an outer step changed (nanotron_ext.sparseloco.hetero.fold_step):
    T_fixed += T_S - T_S U U^T, T_S <- T_S U U^T. One process (the table is not sharded over TP)."""
    from nanotron_ext.sparseloco.hetero import fold_step

    assert emb.tp_pg is None or emb.tp_pg.size() == 1, "a reference for one process"
    t = emb.table.weight
    f = fold_step(t, emb.hub.basis)  # T_S U U^T - T_S
    emb.hub.fixed.sub_(f)
    t.add_(f)
