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
    from nanotron_ext.codecs.bitpack import pack_words, unpack_words, words_for

    values = torch.randint(0, 2**bits, (5, 37), generator=torch.Generator().manual_seed(bits))
    words = pack_words(values, bits)
    assert words.dtype == torch.int32 and words.shape[-1] == words_for(37, bits) == math.ceil(37 / (32 // bits))
    assert torch.equal(unpack_words(words, bits, 37), values)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_receiver_decodes_exactly_and_streamed_codebooks_match_after_k_micro_batches(dtype: torch.dtype) -> None:
    """In either wire dtype; in bf16 the streamed rows cross rounded to bf16 and both sides hold the rounded row."""
    from nanotron_ext.mapl.rvq import decode_from_wire, encode_to_wire

    sender, receiver = _quantizer(), _quantizer()
    k = sender.size
    gen = torch.Generator().manual_seed(2)
    for step in range(2 * k):
        z = torch.randn(2, 8, 16, generator=gen)
        expected = sender.decode(sender.encode(z.reshape(16, 16))).view(2, 8, 16)  # before the stream advances
        wire = encode_to_wire(sender, z, grad_bits=8, learn=step < k, dtype=dtype)
        assert wire.dtype == dtype
        got = decode_from_wire(receiver, wire, 16, grad_bits=8)
        assert torch.equal(got, expected)
        assert torch.equal(sender.shared, receiver.shared)
    # learning stopped K micro-batches ago: every streamed row is the final learning row, as it crossed
    assert torch.equal(receiver.shared, sender.learning.to(dtype).float())
    assert not torch.equal(sender.learning, _quantizer().learning)  # it did learn


def test_the_gradient_crosses_back_quantised_in_either_wire_dtype() -> None:
    """The receiver's dL/dZ_hat reaches the sender's Z as the absmax-quantised gradient (straight-through), the
    same in a bf16 wire as in an fp32 one (the words are bit-cast, not converted)."""
    from nanotron_ext.mapl.rvq import decode_from_wire, encode_to_wire

    g = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    step = g.abs().amax(-1, keepdim=True) / 127
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4)).requires_grad_()
        wire = encode_to_wire(_quantizer(), z, grad_bits=8, learn=True, dtype=dtype)
        sent = wire.detach().requires_grad_()
        decode_from_wire(_quantizer(), sent, 16, grad_bits=8).backward(g)
        assert sent.grad.dtype == dtype
        wire.backward(sent.grad)
        assert ((z.grad - g).abs() <= step / 2 + 1e-12).all()
        grads.append(z.grad)
    assert torch.equal(grads[0], grads[1])


def test_a_code_tape_records_and_replays_every_assignment() -> None:
    """Recording keeps every nearest-codeword decision (R wire + R learn per encode with learning); replaying it
    in a run whose Z differs forces the recorded codes (the decode equals the recorded run's) and counts the
    decisions the run's own argmin would have changed (here: against a brute-force float64 argmin)."""
    from nanotron_ext.mapl.rvq import CodeTape, encode_to_wire

    z = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    noisy = z + 0.3 * torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(6))
    with CodeTape() as tape:
        first = encode_to_wire(_quantizer(), z, grad_bits=8, learn=True)
    assert tape.kinds == ["wire"] * 3 + ["learn"] * 3 and [c.shape for c in tape.codes] == [(16, 4)] * 6
    q = _quantizer()
    own = q.encode(noisy.reshape(16, 16))
    with CodeTape(tape.state()["codes"]) as replay:
        forced = encode_to_wire(q, noisy, grad_bits=8, learn=True)
    assert torch.equal(forced[..., :2], first[..., :2])  # 12 indices of 5 bits, 2 words: the recorded codes crossed
    residual = noisy.reshape(16, 4, 4).double()  # round 1 of the wire: float64 brute force
    book = _quantizer().shared[:, 0].double()
    brute = ((residual.unsqueeze(2) - book.unsqueeze(0)) ** 2).sum(-1).argmin(-1)
    assert torch.equal(brute, own[..., 0])
    assert replay.differ[0] == int((brute != tape.codes[0]).sum()) > 0
    assert replay.disagreement() == sum(replay.differ) / (6 * 16 * 4)
    with pytest.raises(RuntimeError, match="not on the replayed tape"), CodeTape(tape.codes[:1]):
        encode_to_wire(_quantizer(), z, grad_bits=8, learn=False)


def _rvq_worker(steps: int, grad_bits: int = 8, dtype: str = "fp32") -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.mapl.codec import MaplDecoder, MaplEncoder
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from tests.test_parallel_parity import MB, MODEL, N_MICRO, SEQ, _global_batch

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    cfg = small_config({**MODEL, "dtype": dtype,
                        "codec": {"kind": "mapl", "mapl": {"rank": 8, "anchor_width": 4, "vq_groups": 2,
                                                                     "vq_rounds": 2, "vq_codebook": 16,
                                                                     "grad_bits": grad_bits}}},
                       pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
    model = build_model(cfg, ctx)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    side = next(m for m in model.modules() if isinstance(m, (MaplEncoder, MaplDecoder)))
    micro = micro_batches(_global_batch(1), MB, N_MICRO)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):  # as the trainer's replica
            loss, comm = one_step(model, micro, ctx)
        losses.append(loss)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "comm": comm, "pp_rank": dist.get_rank(ctx.pp_pg),
            "A": side.projection.A.detach().clone(),
            "table": side.projection.anchor_table.detach().clone(), "shared": side.quantizer.shared.clone()}


@pytest.mark.slow
@pytest.mark.parametrize("grad_bits,dtype", [(8, "fp32"), (16, "fp32"), (8, "bf16")])
def test_rvq_codec_trains_at_pp2_with_identical_copies_and_counted_bytes(grad_bits: int, dtype: str) -> None:
    """Forward bytes follow the VQ closed form (ids, indices, the streamed codebook row) whatever the
    gradient's width; the backward carries the quantised gradient (the wire's gradient, so its width is
    the larger of the two): r = 8, G = 2, R = 2, K = 16, 16 tokens per micro-batch. Under bf16 the wire is bf16
    (e = 2 B: the streamed row's values take 2 B; integer words are bit-cast, 4 B either way)."""
    from tests.test_parallel_parity import MB, N_MICRO, SEQ

    sender, receiver = run_distributed(_rvq_worker, 2, 3, grad_bits, dtype)
    assert all(math.isfinite(x) for x in sender["losses"])
    assert torch.equal(sender["A"], receiver["A"]) and torch.equal(sender["table"], receiver["table"])
    assert torch.equal(sender["shared"], receiver["shared"])
    tokens, r, groups, rounds, k = MB * SEQ, 8, 2, 2, 16
    e = {"fp32": 4, "bf16": 2}[dtype]
    index_bytes = 4 * math.ceil(groups * rounds / (32 // math.ceil(math.log2(k))))  # 4 indices of 4 bits: 1 word
    stream_bytes = e * math.ceil((4 // e + rounds * r) / tokens)  # int32 row number + one row of every codebook
    forward = index_bytes + stream_bytes
    grad = 4 * (math.ceil(r / (32 // grad_bits)) + 1)  # codes + the fp32 scale
    assert sender["comm"]["pp"]["send:fwd"]["bytes"] == N_MICRO * tokens * (4 + forward)  # + int32 ids
    assert receiver["comm"]["pp"]["send:bwd"]["bytes"] == N_MICRO * tokens * (4 + max(forward, grad))
