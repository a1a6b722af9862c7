"""MAPL's residual vector quantisation against plain references: bit packing round trips, the
quantised gradient is within half a step of the true one, the reconstruction error never grows with
the number of rounds, the receiver decodes exactly what the sender encoded, streamed codebooks are
identical on both sides after K micro-batches, and the wire's bytes are what the layout says (ledger,
PP=2) while both copies of the projection stay identical through training steps."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import micro_batches, one_step, small_config


@pytest.mark.parametrize("bits", [1, 3, 8, 12, 16])
def test_pack_bits_round_trips(bits: int) -> None:
    from nanotron_ext.mapl.rvq import pack_bits, unpack_bits, words_for

    values = torch.randint(0, 2**bits, (5, 37), generator=torch.Generator().manual_seed(bits))
    words = pack_bits(values, bits)
    assert words.dtype == torch.int32 and words.shape[-1] == words_for(37, bits) == math.ceil(37 / (32 // bits))
    assert torch.equal(unpack_bits(words, bits, 37), values)


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_quantised_gradient_is_within_half_a_step(bits: int) -> None:
    from nanotron_ext.mapl.rvq import dequantise_gradient, quantise_gradient

    g = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 1e-3
    back = dequantise_gradient(quantise_gradient(g, bits), bits, 40)
    step = g.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((back - g).abs() <= step / 2 + 1e-12).all()


def _quantizer(rounds: int = 3, seed: int = 0):
    from nanotron_ext.mapl.rvq import ResidualQuantizer

    q = ResidualQuantizer(width=16, groups=4, rounds=rounds, codebook_size=32, decay=0.9)
    q.init_codebooks_(torch.Generator().manual_seed(seed), scale=0.5)
    return q


def test_reconstruction_error_never_grows_with_rounds_and_learning_lowers_it() -> None:
    z = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    q = _quantizer(rounds=4)
    for _ in range(30):
        q.learn(z)
    q.shared.copy_(q.learning)
    errors = []
    for rounds in range(1, 5):
        idx = q.encode(z)[..., :rounds]
        z_hat = sum(q._lookup(q.shared[:, t], idx[..., t]) for t in range(rounds)).reshape(512, 16)
        errors.append(float((z - z_hat).square().sum()))
    assert all(b <= a for a, b in zip(errors, errors[1:])), errors
    fresh = _quantizer(rounds=4)
    assert errors[-1] < 0.5 * float((z - fresh.decode(fresh.encode(z))).square().sum())


def test_receiver_decodes_exactly_and_streamed_codebooks_match_after_k_micro_batches() -> None:
    from nanotron_ext.mapl.rvq import decode_from_wire, encode_to_wire

    sender, receiver = _quantizer(), _quantizer()
    k = sender.size
    gen = torch.Generator().manual_seed(2)
    for step in range(2 * k):
        z = torch.randn(2, 8, 16, generator=gen)
        expected = sender.decode(sender.encode(z.reshape(16, 16))).view(2, 8, 16)  # before the stream advances
        wire = encode_to_wire(sender, z, grad_bits=8, learn=step < k)
        got = decode_from_wire(receiver, wire, 16, grad_bits=8)
        assert torch.equal(got, expected)
        assert torch.equal(sender.shared, receiver.shared)
    # learning stopped K micro-batches ago: every streamed row is the final learning row
    assert torch.equal(receiver.shared, sender.learning)
    assert not torch.equal(sender.learning, _quantizer().learning)  # it did learn


def _rvq_worker(steps: int, grad_bits: int = 8) -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.mapl.codec import MaplDecoder, MaplEncoder
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from tests.test_parallel_parity import MB, MODEL, N_MICRO, SEQ, _global_batch

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    cfg = small_config({**MODEL, "codec": {"kind": "mapl", "mapl": {"rank": 8, "anchor_width": 4, "vq_groups": 2,
                                                                     "vq_rounds": 2, "vq_codebook": 16,
                                                                     "grad_bits": grad_bits}}},
                       pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
    model = build_model(cfg, ctx)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    side = next(m for m in model.modules() if isinstance(m, (MaplEncoder, MaplDecoder)))
    micro = micro_batches(_global_batch(1), MB, N_MICRO)
    losses = []
    for _ in range(steps):
        loss, comm = one_step(model, micro, ctx)
        losses.append(loss)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "comm": comm, "pp_rank": dist.get_rank(ctx.pp_pg), "A": side.projection.A.detach().clone(),
            "table": side.projection.anchor_table.detach().clone(), "shared": side.quantizer.shared.clone()}


@pytest.mark.slow
@pytest.mark.parametrize("grad_bits", [8, 16])
def test_rvq_codec_trains_at_pp2_with_identical_copies_and_counted_bytes(grad_bits: int) -> None:
    """Forward bytes follow the VQ closed form (ids, indices, the streamed codebook row) whatever the
    gradient's width; the backward carries the quantised gradient (the wire's gradient, so its width is
    the larger of the two): r = 8, G = 2, R = 2, K = 16, 16 tokens per micro-batch."""
    from tests.test_parallel_parity import MB, N_MICRO, SEQ

    sender, receiver = run_distributed(_rvq_worker, 2, 3, grad_bits)
    assert all(math.isfinite(x) for x in sender["losses"])
    assert torch.equal(sender["A"], receiver["A"]) and torch.equal(sender["table"], receiver["table"])
    assert torch.equal(sender["shared"], receiver["shared"])
    tokens, r, groups, rounds, k = MB * SEQ, 8, 2, 2, 16
    index_words = math.ceil(groups * rounds / (32 // math.ceil(math.log2(k))))  # 4 indices of 4 bits: 1 word
    stream_words = math.ceil((1 + rounds * r) / tokens)  # row number + one row of every codebook: 17 fp32
    forward_words = index_words + stream_words
    grad_words = math.ceil(r / (32 // grad_bits)) + 1  # codes + the fp32 scale
    assert sender["comm"]["pp"]["send:fwd"]["bytes"] == N_MICRO * tokens * 4 * (1 + forward_words)  # + int32 ids
    assert receiver["comm"]["pp"]["send:bwd"]["bytes"] == N_MICRO * tokens * 4 * (1 + max(forward_words, grad_words))
