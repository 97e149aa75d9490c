"""FP8 GEMMs of the Linears (issue 35; model/fp8_linear.py, `model.fp8.enabled`): the CPU emulation of the
forward, dgrad and wgrad GEMMs against a hand-made per-block computation (tests/hand_formats.py: every
block's power-of-two scale and E4M3 values by hand, products summed in fp64) on inputs that tell a right
recipe from a near miss -- a zero block, amax at a block edge, E4M3 ties, subnormal codes, partial blocks at
every edge --, on its own and inside a flash_tiny forward and backward; the block-scaled GEMM against
`torch._scaled_mm`'s row-wise mode block by block (the scaling mode the CPU build runs); selective
recomputation keeps the FP8 GEMM's output; the memory estimator's fake tensors pass through it.
The Triton kernel is checked against the same reference under the interpreter
(tests/triton_interpret/test_fp8_gemm_kernel.py)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hand_formats import BLOCK, adversarial, fp8_block, fp8_rows, fp8_tiles
from layer_plans import FOUR_LAYERS
from torch._subclasses.fake_tensor import FakeTensorMode

from flashtrain.model import fp8_linear as fp8_linear_module
from flashtrain.model.fp8_linear import fp8_block_gemm_reference, fp8_linear, quant_rows
from flashtrain.train.config import compose, model_config

FP32_ULP = 2.0 ** -24


def assert_sums(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> torch.Tensor:
    """got [M, N] against sum_k a[m, k] b[n, k] in fp64, within the fp32 rounding of a K-term sum
    (K ulps of the sum of |terms|); returns that bound. a, b: the hand-quantised fp64 operands."""
    want = a @ b.t()
    bound = a.shape[1] * FP32_ULP * (a.abs() @ b.abs().t())
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{what}: off by {(err - bound).max().item():.3g} beyond fp32 rounding"
    return bound


def test_forward_dgrad_and_wgrad_against_the_hand_blocks():
    """x [40 tokens, 80] (K = 80: a partial block of 16), W [48, 80] (a partial row of tiles), dy [40, 48]:
    y = Q(x) Q(W)^T with x in 1 x 32 blocks and W in 32 x 32 tiles; dx = Q(dy) Q(W) with dy in 1 x 32 blocks
    along the 48 outputs; dW = Q(dy^T) Q(x'^T)^T in blocks of 32 tokens (the last one 8), x' the forward's
    FP8 x dequantised. Each against the hand blocks; the fp32 GEMM of the unquantised tensors and one scale
    per token both miss by far more than the rounding bound."""
    x = adversarial((40, 80), 1).requires_grad_()
    w = (adversarial((48, 80), 2) * 1e-2).requires_grad_()
    dy = adversarial((40, 48), 3)
    y = fp8_linear(x, w)
    y.backward(dy)
    xq, wq = fp8_rows(x.detach()), fp8_tiles(w.detach())
    bound = assert_sums(y, xq, wq, "forward")
    assert ((x.detach() @ w.detach().t()).double() - xq @ wq.t()).abs().gt(100 * bound).any()
    per_row = torch.tensor([[c * s for c in codes] for codes, s in map(fp8_block, x.detach().tolist())],
                           dtype=torch.float64)  # one scale per token (a row-wise recipe)
    assert (per_row @ wq.t() - xq @ wq.t()).abs().gt(100 * bound).any()
    assert_sums(x.grad, fp8_rows(dy), wq.t(), "dgrad")
    assert_sums(w.grad, fp8_rows(dy.t()), fp8_rows(xq.float().t()), "wgrad")


def test_wgrad_requantises_the_saved_fp8_activations():
    """The wgrad operand is x's FP8 value (what the forward keeps), re-quantised in blocks of 32 tokens -- as the
    V3 report describes its backward -- not x itself. E4M3 is a float format, so the two differ only where the
    second scale pushes a value into the subnormal codes; built here: token 0 holds v = 1.4375 x 2^-9 in
    channel 0 (its own scale keeps it normal: 1.0111b rounds to the even 1.100b = 1.5 x 2^-9), token 1 holds
    448 in that channel (token-block scale 1: subnormal step 2^-9). From the FP8 value v is 1.5 steps -> 2
    (the even one); from x it is 1.4375 steps -> 1."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 32, generator=g) * 1e-3
    v = 1.4375 * 2.0 ** -9
    x[0] = v * (1 + 0.1 * torch.rand(32, generator=g))
    x[0, 0] = v
    x[1, 0] = 448.0
    x.requires_grad_()
    w = adversarial((32, 32), 5).requires_grad_()
    dy = torch.randn(32, 32, generator=g) * 1e-3
    dy[0] = 1000.0 * (1 + torch.rand(32, generator=g))
    fp8_linear(x, w).backward(dy)
    xq = fp8_rows(x.detach())
    assert xq[0, 0] == 1.5 * 2.0 ** -9
    saved_t, x_t = fp8_rows(xq.float().t()), fp8_rows(x.detach().t())
    assert saved_t[0, 0] == 2 * 2.0 ** -9 and x_t[0, 0] == 2.0 ** -9
    bound = assert_sums(w.grad, fp8_rows(dy.t()), saved_t, "wgrad")
    from_x = fp8_rows(dy.t()) @ x_t.t()
    assert ((w.grad.double() - from_x)[:, 0].abs() > 100 * bound[:, 0]).all()


def test_block_scaled_gemm_is_scaled_mm_row_wise_block_by_block():
    """`torch._scaled_mm` runs E4M3 x E4M3 with per-row x per-column scales on the CPU: one call per block of
    32 along K, with that block's scales, summed, is the block-scaled GEMM (what the reference computes and
    the kernel runs as one GEMM)."""
    a, sa = quant_rows(adversarial((24, 96), 7))
    b, sb = quant_rows(adversarial((40, 96), 8))
    ref = fp8_block_gemm_reference(a, sa, b, sb, torch.float32)
    total = torch.zeros(24, 40, dtype=torch.float64)
    for j in range(96 // BLOCK):
        cols = slice(BLOCK * j, BLOCK * (j + 1))
        total += torch._scaled_mm(a[:, cols].contiguous(), b[:, cols].contiguous().t(), sa[:, j:j + 1].contiguous(),
                                  sb[:, j:j + 1].t().contiguous(), out_dtype=torch.float32).double()
    bound = 96 * FP32_ULP * (fp8_rows_abs(a, sa) @ fp8_rows_abs(b, sb).t())
    assert ((ref.double() - total).abs() <= bound).all()


def fp8_rows_abs(codes, scales):
    return (codes.double().abs().unflatten(-1, (-1, BLOCK)) * scales.double().unsqueeze(-1)).flatten(-2)


class GemmCount:
    """Counts the FP8 GEMMs that run: calls of the op's CPU implementation (the reference), which a GEMM whose
    output selective recomputation replays from its cache does not reach."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = fp8_linear_module.fp8_block_gemm_reference

        def counted(*args):
            self.n += 1
            return real(*args)

        monkeypatch.setattr(fp8_linear_module, "fp8_block_gemm_reference", counted)


@pytest.fixture(scope="module")
def fp8_tiny():
    """flash_tiny (four-layer plan) with FP8 GEMMs, and one batch."""
    cfg = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS, "model.fp8.enabled=true"]))
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    return cfg, tokens


def _model(cfg, recompute="none"):
    from flashtrain.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg)
    model.set_recompute(recompute)
    return model


def test_a_flash_tiny_linear_in_fp8_against_the_hand_blocks(fp8_tiny):
    """Inside a flash_tiny forward and backward (layer 2, a Full layer): its `wq_a` (x: the normed block input,
    K = dim = 64) and `wo_b` (K = o_groups x o_lora_rank = 32) compute output, input gradient and weight
    gradient as the hand blocks say, on the activations and gradients the model gives them."""
    cfg, tokens = fp8_tiny
    model = _model(cfg)
    seen = {}
    for name in ("wq_a", "wo_b"):
        lin = getattr(model.layers[2].attn, name)
        lin.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, {}).update(x=i[0], y=o))
        lin.register_full_backward_hook(lambda m, gi, go, name=name: seen[name].update(dx=gi[0], dy=go[0]))
    model(tokens).float().square().mean().backward()
    for name in ("wq_a", "wo_b"):
        lin, s = getattr(model.layers[2].attn, name), seen[name]
        x, dy = s["x"].detach().flatten(0, 1), s["dy"].flatten(0, 1)
        xq, wq = fp8_rows(x), fp8_tiles(lin.weight.detach())
        assert_sums(s["y"].flatten(0, 1), xq, wq, f"{name} forward")
        assert_sums(s["dx"].flatten(0, 1), fp8_rows(dy), wq.t(), f"{name} dgrad")
        assert_sums(lin.weight.grad, fp8_rows(dy.t()), fp8_rows(xq.float().t()), f"{name} wgrad")
        assert x.abs().amax(-1).min() > 0 and dy.abs().amax(-1).min() > 0  # real, non-zero traffic


def test_selective_recomputation_keeps_the_fp8_gemm_outputs(fp8_tiny, monkeypatch):
    """Selective recomputation keeps the FP8 GEMMs' outputs (model/recompute.py): its backward runs the dgrad
    and wgrad GEMMs and none of the forward's again, and gives the loss and gradients of no recomputation,
    bit for bit (the quantisation is deterministic)."""
    cfg, tokens = fp8_tiny
    tokens = tokens[:1]
    count = GemmCount(monkeypatch)
    out = {}
    for m in ("none", "selective"):
        model = _model(cfg, m)
        count.n = 0
        loss = model(tokens).float().square().mean()
        forward, count.n = count.n, 0
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[m] = (loss.item(), grads, forward, count.n)
    (l0, g0, f0, b0), (l1, g1, f1, b1) = out["none"], out["selective"]
    assert l0 == l1 and g0.keys() == g1.keys()
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert f0 == f1 >= 4 * 6 and b0 > f0  # every FP8 Linear of the four blocks; dgrad + wgrad
    assert b1 == b0  # no forward GEMM again


def test_fake_tensors_take_the_fp8_path_and_keep_fp8_activations():
    """The memory estimator runs the step on fake tensors: the FP8 Linear's forward and backward go through
    (the GEMM op's shape function) and the forward keeps x as E4M3 codes and scales (1 + 1/8 bytes a value),
    not x itself."""
    with FakeTensorMode():
        x = torch.empty(256, 512, requires_grad=True)
        w = torch.empty(384, 512, requires_grad=True)
        y = fp8_linear(x, w)
        assert y.shape == (256, 384) and y.dtype == torch.float32
        saved = y.grad_fn.saved_tensors
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert [t.dtype for t in saved].count(torch.float8_e4m3fn) == 2  # x's codes and W's
    assert sum(t.numel() * t.element_size() for t in saved if t.shape[0] == 256) == 256 * 512 * (1 + 4 / 32)


def test_the_fp8_model_stays_near_the_plain_one(fp8_tiny):
    """A sanity bound, not the recipe's pin: flash_tiny's logits with FP8 GEMMs are within a few percent of the
    plain fp32 model's (E4M3 keeps 3 mantissa bits: ~2^-5 relative per operand), and differ from them."""
    cfg, tokens = fp8_tiny
    plain = _model(dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, enabled=False)))
    a, b = _model(cfg)(tokens), plain(tokens)
    rel = (a - b).norm() / b.norm()
    assert 0 < rel < 0.05
    assert F.cross_entropy(a.flatten(0, 1), tokens.flatten()).isfinite()


def test_no_host_syncs():
    """The FP8 Linear's three GEMMs and the weights' formats read nothing back to the host (on CUDA a
    synchronisation per Linear would stall the stream)."""
    from host_syncs import HostSyncs

    from flashtrain.model.config import QATConfig
    from flashtrain.model.formats import Stored, as_trained

    qat = QATConfig(experts_fp4=True, weights_fp8=True, weights_bf16=True)
    x, w = adversarial((40, 80), 1).requires_grad_(), adversarial((48, 80), 2).requires_grad_()
    experts = adversarial((48, 64), 3).view(2, 24, 64).requires_grad_()
    with HostSyncs() as syncs:
        fp8_linear(x, w).sum().backward()
        for fmt in Stored:
            as_trained(experts, fmt, qat).sum().backward()
    assert syncs.events == []
