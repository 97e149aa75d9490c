"""Optimizers (V41_SPEC §7) against independent references: SVD, literal Algorithm 1, hand-rolled
momentum loops; routing of every flash_tiny parameter; state_dict round trips."""

import collections
import io
import math
import re

import pytest
import torch

from flashtrain.train.config import model_config
from flashtrain.train.optim import Muon, SinkhornBalanced, newton_schulz_reference
from flashtrain.train.optim.newton_schulz import V41_NS_SCHEDULE
from flashtrain.train.optim.sinkhorn import sinkhorn_update_reference


def _with_singular_values(m, n, svals, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    k = min(m, n)
    return (U[:, :k] * svals) @ V[:, :k].T


@pytest.mark.parametrize("m, n", [(64, 64), (96, 40), (40, 96)])
def test_hybrid_newton_schulz_singular_values_near_one(m, n):
    torch.manual_seed(0)
    random = torch.randn(m, n)
    ill = _with_singular_values(m, n, torch.logspace(0, -3, min(m, n)))  # condition number 1e3
    for G in (random, ill):
        O = newton_schulz_reference(G, V41_NS_SCHEDULE)
        s = torch.linalg.svdvals(O)
        assert (s - 1).abs().max() < 1e-2, s
        # and it is the polar factor U V^T of G (SVD), not just some orthogonal matrix
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        torch.testing.assert_close(O, U @ Vh, atol=2e-2, rtol=0)


def _muon(params, **kw):
    return Muon(params, lr=0.02, momentum=0.9, weight_decay=0.1, **kw)


def test_muon_step_matches_hand_rolled_loop_over_two_steps():
    torch.manual_seed(0)
    W0 = torch.randn(12, 20)
    grads = [torch.randn(12, 20), torch.randn(12, 20)]
    p = torch.nn.Parameter(W0.clone())
    opt = _muon([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    # by hand: M = b M + (1-b) G; G^ = b M + (1-b) G; W = W (1 - lr wd) - lr * NS(G^) * 0.18 * sqrt(20)
    W, M = W0.clone(), torch.zeros(12, 20)
    for g in grads:
        M = 0.9 * M + 0.1 * g
        Gh = 0.9 * M + 0.1 * g
        U, _, Vh = torch.linalg.svd(Gh, full_matrices=False)
        W = W * (1 - 0.02 * 0.1) - 0.02 * (U @ Vh) * 0.18 * math.sqrt(20)
    torch.testing.assert_close(p.detach(), W, atol=5e-4, rtol=0)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], M)


PUBLISHED_NS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2  # V41_SPEC §7, written out


def literal_ns_singular_value(s, coefficients, eps=1e-7, frob=1.0):
    """Newton-Schulz acts on each singular value alone: s <- a s + b s^3 + c s^5, from s / (||G||_F + eps)."""
    s = s / (frob + eps)
    for a, b, c in coefficients:
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def test_the_optimizer_runs_the_published_newton_schulz_constants():
    """The constants in the code and the ones the config builds are the published ones, and the
    optimizer really applies them: one Muon step (no weight decay, so the update is the whole change)
    moves a matrix G = U diag(s) V^T by lr * 0.18 * sqrt(max(rows, cols)) * U diag(f(s)) V^T, with f the
    scalar iteration above -- exact, unlike the approximate polar factor."""
    from flashtrain.model import Transformer
    from flashtrain.train.config import compose, optim_config
    from flashtrain.train.optim import build_optimizers

    assert V41_NS_SCHEDULE == PUBLISHED_NS
    assert Muon([torch.nn.Parameter(torch.zeros(2, 2))]).ns_coefficients == PUBLISHED_NS
    ocfg = optim_config(compose(["+exp=flash_tiny"]))
    assert ocfg.muon.coefficients() == PUBLISHED_NS
    with torch.device("meta"):
        model = Transformer(model_config(compose(["+exp=flash_tiny"])), init=False)
    muon = build_optimizers(model, model_config(compose(["+exp=flash_tiny"])), ocfg, lr=2.6e-4).optimizers["muon"]
    assert muon.ns_coefficients == PUBLISHED_NS and muon.ns_eps == 1e-7
    for m, n in ((24, 10), (10, 24)):  # tall and wide
        svals = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.05, 0.01, 1e-3, 1e-4, 3e-5, 0.3], dtype=torch.float64)
        G = _with_singular_values(m, n, svals.float(), seed=m)
        U, s, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        f = literal_ns_singular_value(s, PUBLISHED_NS, frob=s.norm().item())
        W0 = torch.randn(m, n)
        p = torch.nn.Parameter(W0.clone())
        p.grad = G.clone()
        Muon([p], lr=0.01, weight_decay=0.0, ns_coefficients=muon.ns_coefficients).step()
        want = W0.double() - 0.01 * 0.18 * math.sqrt(max(m, n)) * (U * f) @ Vh
        torch.testing.assert_close(p.detach().double(), want, atol=1e-5, rtol=0)
        # the schedule matters at this precision: 7 main steps, or the two sets swapped, give other numbers
        for other in (PUBLISHED_NS[1:], PUBLISHED_NS[8:] + PUBLISHED_NS[:8]):
            moved = (0.01 * 0.18 * math.sqrt(max(m, n))
                     * (U * (literal_ns_singular_value(s, other, frob=s.norm().item()) - f)) @ Vh)
            assert moved.abs().max() > 10 * 1e-5


def literal_bf16_newton_schulz(G, coefficients, eps=1e-7):
    """Newton-Schulz with bf16 GEMMs, literally: bf16 input, every product computed exactly (fp64) and stored
    in bf16, as a bf16 GEMM with fp32 accumulation stores it."""
    def bf16(x):
        return x.to(torch.bfloat16).double()

    X = G.to(torch.bfloat16)
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + eps)).double()
    for a, b, c in coefficients:
        A = bf16(X @ X.mT)
        B = bf16(b * A + c * A @ A)
        X = bf16(a * X + B @ X)
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(3, 24, 40), (3, 40, 24)])
def test_bf16_newton_schulz_from_fp32_gemms_has_bf16_numerics(shape):
    """bf16 Newton-Schulz on a CPU without bf16 GEMMs runs fp32 GEMMs on bf16 values, rounding each product to
    bf16: the numerics of bf16 GEMMs (torch.optim.Muon's precision), not fp32's. After 2 steps its entries
    equal the literal bf16 iteration's but for a few percent (ties and fp32-accumulation boundaries, which
    later steps spread); fp32 iterates (no rounding) agree on about a third of them."""
    from flashtrain.train.optim.newton_schulz import newton_schulz_reference as ns

    torch.manual_seed(7)
    G = torch.randn(*shape)
    want = literal_bf16_newton_schulz(G, PUBLISHED_NS[:2])
    got = ns(G, PUBLISHED_NS[:2], dtype=torch.bfloat16, native=False)
    assert got.dtype == torch.bfloat16 and got.shape == G.shape
    same = (got.double() == want).double().mean().item()
    assert same > 0.9 and ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2, same
    fp32 = ns(G, PUBLISHED_NS[:2], dtype=torch.float32).bfloat16().double()
    assert (fp32 == want).double().mean().item() < 0.6  # the comparison tells the precisions apart


@pytest.mark.parametrize("shape", [(2, 16, 24), (2, 24, 16)])
def test_muon_bf16_step_is_the_literal_bf16_iteration_on_its_g_hat(shape):
    """The Muon step with NS in bf16 (fp32 GEMMs on bf16 values, so on any CPU): the momentum's lerp writes G^,
    then bf16 Newton-Schulz -- a tall matrix from the other side, not
    transposed -- equals the literal bf16 iteration on the fp32 G^ but for a few percent of entries (the
    existing NS test's criteria). With W0 = 0 and no decay, W1 = -lr x scale x O, whose bf16 rounding after
    dividing by lr x scale is O again (fp32's error is far below half a bf16 step)."""
    torch.manual_seed(11)
    g, m0 = torch.randn(shape), torch.randn(shape)
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = g.clone()
    opt = Muon([p], lr=0.5, momentum=0.9, weight_decay=0.0, rms_scale=0.25, ns_dtype=torch.bfloat16,
               ns_native=False, ns_coefficients=PUBLISHED_NS[:2])
    opt.state[p]["momentum_buffer"] = m0.clone()
    opt.step()
    scale = 0.25 * math.sqrt(24)  # rms_scale x sqrt(the longer side)
    got = (-p.detach().double() / (0.5 * scale))
    m1 = torch.lerp(m0, g, 0.1)
    want = literal_bf16_newton_schulz(torch.lerp(g, m1, 0.9), PUBLISHED_NS[:2])
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], m1, atol=0, rtol=0)
    same = (got.to(torch.bfloat16).double() == want).double().mean().item()
    assert same > 0.9 and ((got - want).abs().max() / want.abs().max()).item() < 1e-2, same


def test_muon_slices_by_default_2_20_values_on_the_cpu_2_22_on_cuda():
    """On the CPU, Newton-Schulz runs in slices of 2^20 values (NS_BATCH_ELEMS, docs/kernels.md: faster than
    2^22 there); 4100 matrices of 16 x 16 (1,049,600 values) take a workspace of 4096 of them."""
    p = torch.nn.Parameter(torch.zeros(4100, 16, 16))
    p.grad = torch.randn(4100, 16, 16)
    opt = _muon([p], ns_coefficients=PUBLISHED_NS[:1])
    opt.step()
    assert opt._ghat_workspace.numel() == 4096 * 256 == 1 << 20 and opt._ghat_workspace.dtype == torch.float32
    assert opt._slice_elems(torch.device("cuda")) == 1 << 22  # a CUDA device keeps 2^22: no GPU needed to ask


@pytest.mark.parametrize("shape", [(20, 12), (12, 20)])
def test_muon_update_scale_uses_the_longer_side(shape):
    """Tall and wide: O = UV^T * 0.18 * sqrt(max(rows, cols)) (so its RMS is 0.18 for any aspect)."""
    m, n = shape
    torch.manual_seed(1)
    W0, g = torch.randn(m, n), torch.randn(m, n)
    p = torch.nn.Parameter(W0.clone())
    p.grad = g.clone()
    _muon([p]).step()
    Gh = 0.9 * (0.1 * g) + 0.1 * g
    U, _, Vh = torch.linalg.svd(Gh, full_matrices=False)
    want = W0 * (1 - 0.02 * 0.1) - 0.02 * (U @ Vh) * 0.18 * math.sqrt(max(m, n))
    torch.testing.assert_close(p.detach(), want, atol=5e-4, rtol=0)
    update = (W0 * (1 - 0.02 * 0.1) - p.detach()) / 0.02
    assert update.pow(2).mean().sqrt().item() == pytest.approx(0.18, rel=2e-2)


def test_tall_head_blocks_and_tall_experts_are_scaled_by_their_own_longer_side():
    """Head-wise Muon on a [H * d, in] weight with d > in (tall blocks), and stacked experts [E, out, in]
    with out > in: each block / expert gets its own U V^T * 0.18 * sqrt(max(d, in)), checked by SVD."""
    torch.manual_seed(2)
    H, d, k = 3, 16, 6
    W0, g = torch.randn(H * d, k), torch.randn(H * d, k)
    p = torch.nn.Parameter(W0.clone())
    p.grad = g.clone()
    _muon([{"params": [p], "num_heads": H}]).step()
    E, o, i = 2, 18, 7
    X0, gx = torch.randn(E, o, i), torch.randn(E, o, i)
    q = torch.nn.Parameter(X0.clone())
    q.grad = gx.clone()
    _muon([q]).step()

    def by_svd(W, G, rows, cols):
        U, _, Vh = torch.linalg.svd(0.19 * G, full_matrices=False)  # Nesterov first step: (1-b)(1+b) G
        return W * (1 - 0.02 * 0.1) - 0.02 * (U @ Vh) * 0.18 * math.sqrt(max(rows, cols))

    want = torch.cat([by_svd(W0[h * d:(h + 1) * d], g[h * d:(h + 1) * d], d, k) for h in range(H)])
    torch.testing.assert_close(p.detach(), want, atol=5e-4, rtol=0)
    torch.testing.assert_close(q.detach(), torch.stack([by_svd(X0[e], gx[e], o, i) for e in range(E)]),
                               atol=5e-4, rtol=0)


def test_headwise_muon_equals_muon_on_separate_head_blocks():
    torch.manual_seed(0)
    H, d, k = 4, 8, 24
    W0, g = torch.randn(H * d, k), torch.randn(H * d, k)
    p = torch.nn.Parameter(W0.clone())
    opt = _muon([{"params": [p], "num_heads": H}])
    blocks = [torch.nn.Parameter(W0[h * d:(h + 1) * d].clone()) for h in range(H)]
    ref = _muon(blocks)
    for _ in range(2):
        p.grad = g.clone()
        for h, b in enumerate(blocks):
            b.grad = g[h * d:(h + 1) * d].clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), torch.cat([b.detach() for b in blocks]), atol=1e-6, rtol=1e-6)
    # ... and differs from treating the whole matrix as one
    whole = torch.nn.Parameter(W0.clone())
    whole.grad = g.clone()
    _muon([whole]).step()
    assert (whole.detach() - p.detach()).abs().max() > 1e-3


def test_stacked_experts_are_independent_matrices():
    torch.manual_seed(0)
    E = torch.randn(3, 10, 16)
    g = torch.randn(3, 10, 16)
    p = torch.nn.Parameter(E.clone())
    p.grad = g.clone()
    _muon([p]).step()
    for e in range(3):
        q = torch.nn.Parameter(E[e].clone())
        q.grad = g[e].clone()
        _muon([q]).step()
        torch.testing.assert_close(p[e].detach(), q.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_slices_cut_across_parameters_and_each_matrix_moves_once(nesterov):
    """Newton-Schulz slices of `ns_batch_elems` values that cut across parameters (matrices of one shape laid
    end to end: [3, 6, 10] | [2, 6, 10] | [6, 10] in slices of 2 matrices), a second shape whose slice needs a
    larger workspace than the first's, two steps, with and without Nesterov: every matrix moves by the
    hand-rolled step with its own polar factor (SVD), weight decay applied once."""
    torch.manual_seed(5)
    shapes = [(2, 4, 5), (4, 5), (3, 6, 10), (2, 6, 10), (6, 10)]
    W0 = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(2)]
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = _muon(params, nesterov=nesterov, ns_batch_elems=120)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    assert opt._ghat_workspace.numel() == 120  # 3 matrices of 4 x 5, then 2 of 6 x 10
    for i, shape in enumerate(shapes):
        W, M = W0[i].reshape(-1, *shape[-2:]).clone(), torch.zeros(shape).reshape(-1, *shape[-2:])
        for step in grads:
            g = step[i].reshape(M.shape)
            M = 0.9 * M + 0.1 * g
            Gh = 0.9 * M + 0.1 * g if nesterov else M
            U, _, Vh = torch.linalg.svd(Gh, full_matrices=False)
            W = W * (1 - 0.02 * 0.1) - 0.02 * (U @ Vh) * 0.18 * math.sqrt(max(shape[-2:]))
        torch.testing.assert_close(params[i].detach(), W.reshape(shape), atol=5e-4, rtol=0)


def literal_algorithm_1(W, G, M, lr, beta=0.95, K=11, tau=1e-3, eps=1e-20, gamma=0.18):
    """V41_SPEC §7 Algorithm 1, transcribed with a materialised U."""
    M = beta * M + (1 - beta) * G
    Gh = beta * M + (1 - beta) * G
    rho = Gh.norm(dim=1)
    U = Gh.clone()
    U[rho <= tau * rho.mean()] = 0
    for k in range(1, K + 1):
        if k % 2 == 1:
            U = U / (U.norm(dim=1, keepdim=True) + eps)
        else:
            U = U / (U.norm(dim=0, keepdim=True) + eps)
    return W - gamma * lr * math.sqrt(W.shape[1]) * U, M


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("m, n", [(200, 24), (24, 200), (50, 50)])
def test_sinkhorn_update_matches_literal_algorithm(m, n, consume):
    torch.manual_seed(0)
    W, G, M = torch.randn(m, n), torch.randn(m, n), torch.randn(m, n)
    masked = [3, 7]
    G[masked] *= 1e-6
    M[masked] *= 1e-6
    W_lit, M_lit = literal_algorithm_1(W, G, M, lr=0.1)
    W2, M2, G2 = W.clone(), M.clone(), G.clone()
    sinkhorn_update_reference(W2, G2, M2, 0.1, 0.95, 11, 1e-3, 1e-20, 0.18, chunk_elems=7 * n,  # several chunks
                              consume_grad=consume)
    # the gradient: as it came, or (consumed) G^ = beta M + (1 - beta) G of the new momentum
    torch.testing.assert_close(G2, 0.95 * M_lit + 0.05 * G if consume else G, atol=0 if not consume else 1e-6,
                               rtol=0 if not consume else 1e-5)
    step = W_lit - W
    assert ((W2 - W_lit).abs().max() / step.abs().max()).item() < 1e-5
    torch.testing.assert_close(M2, M_lit)
    # rows of the update have RMS 1 (in units of gamma lr), masked rows are untouched
    delta = (W - W2) / (0.18 * 0.1)
    rms = delta.pow(2).mean(dim=1).sqrt()
    keep = torch.ones(m, dtype=torch.bool)
    keep[masked] = False
    torch.testing.assert_close(rms[keep], torch.ones(int(keep.sum())), atol=1e-5, rtol=0)
    assert (delta[masked] == 0).all()


def _sinkhorn_vs_literal(W, G, M, K=11, chunk_rows=7, consume=False, lr=0.1):
    """The reference update against the literal Algorithm 1 (its U materialised): the largest differences of W
    and of the momentum, relative to the largest entry of the step and of the momentum."""
    W_lit, M_lit = literal_algorithm_1(W.double(), G.double(), M.double(), lr=lr, K=K)
    W2, M2 = W.clone(), M.clone()
    sinkhorn_update_reference(W2, G.clone(), M2, lr, 0.95, K, 1e-3, 1e-20, 0.18, chunk_elems=chunk_rows * W.shape[1],
                              consume_grad=consume)
    step = (W_lit - W.double()).abs().max()
    return ((W2.double() - W_lit).abs().max() / step).item(), ((M2.double() - M_lit).abs().max()
                                                                / M_lit.abs().max()).item()


@pytest.mark.parametrize("K", [1, 3, 5])
def test_sinkhorn_few_normalisations_match_literal_algorithm(K):
    """K = 1 (the first pass's row norms are row step 1; no column step) and K = 3, 5 (row step 1's column
    statistic gathered in the first pass)."""
    torch.manual_seed(3)
    W, G, M = torch.randn(90, 20), torch.randn(90, 20), torch.randn(90, 20)
    for consume in (False, True):
        dw, dm = _sinkhorn_vs_literal(W, G, M, K=K, consume=consume)
        assert dw < 1e-5 and dm < 1e-6, (K, consume, dw, dm)


def test_sinkhorn_reference_off_the_host_reads_nothing_back(monkeypatch):
    """On an accelerator (`_decides_on_host` False) the reference reads no value back -- no row corrections
    picked by `nonzero`, no range checks by `float` -- and runs the literal passes, still Algorithm 1; on the
    host the squared path reads its decisions (one `float` per column-step range check, the mean, the rows to
    correct)."""
    from host_syncs import HostSyncs

    from flashtrain.train.optim import sinkhorn

    torch.manual_seed(8)
    W, G, M = torch.randn(60, 12), torch.randn(60, 12), torch.randn(60, 12)

    def events():
        with HostSyncs() as s:
            sinkhorn_update_reference(W.clone(), G.clone(), M.clone(), 0.1, 0.95, 5, 1e-3, 1e-20, 0.18, 7 * 12)
        return collections.Counter(s.events)

    # K = 5: the mean, the rows to correct, the range check before row steps 3 and 5
    assert events() == {"aten._local_scalar_dense.default": 3, "aten.nonzero.default": 1}
    monkeypatch.setattr(sinkhorn, "_decides_on_host", lambda W: False)
    assert events() == {}
    for consume in (False, True):
        dw, dm = _sinkhorn_vs_literal(W, G, M, K=5, consume=consume)
        assert dw < 1e-5 and dm < 1e-6, (consume, dw, dm)


@pytest.mark.parametrize("first", ["small", "large"])
def test_sinkhorn_running_row_mask_is_corrected_row_by_row(first):
    """The first pass counts rows in row step 1's column statistic with the mask of the rows seen so far (tau
    times their running mean): rows a later, larger mean masks must be taken back, rows an early large mean
    left out must be added. Here whole chunks sit on the wrong side of the running threshold: the first 14
    rows have norms ~1e-3 and the rest ~10 (first="small": counted at first, 1e-3 > tau x their own mean,
    masked at the end, tau x mean = 1e-3 x ~9), or the first 14 rows ~1e4 and the rest ~3 (first="large":
    the rows after them left out until the running mean falls below 3000, kept at the end, tau x mean = 1)."""
    torch.manual_seed(4)
    m, n = 140, 16
    W, G, M = torch.randn(m, n), torch.randn(m, n), torch.randn(m, n)
    head, tail = (1e-3 / 4, 10 / 4) if first == "small" else (1e4 / 4, 3 / 4)
    G[:14] *= head
    M[:14] *= head
    G[14:] *= tail
    M[14:] *= tail
    rho = torch.lerp(G, M.lerp(G, 0.05), 0.95).norm(dim=1)
    keep = rho > 1e-3 * rho.mean()
    assert (keep[:14] == (first == "large")).all() and keep[14:].all()  # the case the test means
    for consume in (False, True):
        dw, dm = _sinkhorn_vs_literal(W, G, M, chunk_rows=7, consume=consume)
        assert dw < 1e-5 and dm < 1e-6, (consume, dw, dm)


def test_sinkhorn_zero_column_stays_zero_as_in_the_literal_algorithm():
    """A feature column that is 0 in every row: Algorithm 1 leaves it 0 (0 / (0 + eps)); scales kept as
    vectors must not grow it by 1/eps a column step into inf * 0 = nan."""
    torch.manual_seed(5)
    W, G, M = torch.randn(64, 16), torch.randn(64, 16), torch.randn(64, 16)
    G[:, 3] = 0
    M[:, 3] = 0
    for consume in (False, True):
        dw, dm = _sinkhorn_vs_literal(W, G, M, consume=consume)
        assert dw < 1e-5 and dm < 1e-6, (consume, dw, dm)


@pytest.mark.parametrize("case", ["tiny table", "faint column"])
def test_sinkhorn_outside_the_squared_range_runs_on_scaled_values(case, monkeypatch):
    """The gemv passes square the scales (r^2, c^2); far below fp32's normal range (a table of norms ~1e-16,
    or a column ~1e-17 of the others, whose scale c_j then exceeds 1e15) the update runs on the scaled values
    instead, as the literal algorithm does, and still matches it."""
    from flashtrain.train.optim import sinkhorn

    calls = []
    scaled = sinkhorn._scaled_passes
    monkeypatch.setattr(sinkhorn, "_scaled_passes", lambda *a: calls.append(1) or scaled(*a))
    torch.manual_seed(6)
    W, G, M = torch.randn(64, 16), torch.randn(64, 16), torch.randn(64, 16)
    if case == "tiny table":
        G, M = G * 1e-17, M * 1e-17
    else:
        G[:, 5] *= 1e-17
        M[:, 5] *= 1e-17
    for consume in (False, True):
        dw, dm = _sinkhorn_vs_literal(W, G, M, consume=consume)
        assert dw < 1e-5 and dm < 1e-6, (consume, dw, dm)
    assert len(calls) == 2


def test_sinkhorn_optimizer_momentum_over_two_steps_matches_hand_loop():
    torch.manual_seed(0)
    W0 = torch.randn(30, 8)
    grads = [torch.randn(30, 8), torch.randn(30, 8)]
    p = torch.nn.Parameter(W0.clone())
    opt = SinkhornBalanced([p], lr=0.05)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    W, M = W0.clone(), torch.zeros(30, 8)
    for g in grads:
        W, M = literal_algorithm_1(W, g, M, lr=0.05)
    torch.testing.assert_close(p.detach(), W, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], M)


def test_sinkhorn_rejects_even_step_counts():
    with pytest.raises(ValueError, match="odd"):
        SinkhornBalanced([torch.nn.Parameter(torch.zeros(2, 2))], num_steps=10)


@pytest.mark.parametrize("make", ["muon", "sinkhorn", "adamw"])
def test_state_dict_round_trip(make):
    """The state the checkpoint and the rollback snapshots save and restore (`owned_state` /
    `install_state`, train/checkpoint.py) continues the run exactly."""
    from flashtrain.train.optim.adamw import ShardedAdamW

    torch.manual_seed(0)
    build = {"muon": lambda ps: Muon(ps, lr=0.01), "sinkhorn": lambda ps: SinkhornBalanced(ps, lr=0.01),
             "adamw": lambda ps: ShardedAdamW([{"params": ps}], lr=0.01, betas=(0.9, 0.95), eps=1e-20)}[make]
    W0 = torch.randn(16, 12)
    grads = [torch.randn(16, 12) for _ in range(3)]
    a = torch.nn.Parameter(W0.clone())
    opt_a = build([a])
    for g in grads[:2]:
        a.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()  # through serialisation, as a checkpoint would
    torch.save([(k, v) for _, k, v, _ in opt_a.owned_state()], buf)
    buf.seek(0)
    saved = torch.load(buf)
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = build([b])
    for k, v in saved:
        opt_b.install_state(b, k, v if torch.is_tensor(v) else torch.tensor(v))
    a.grad, b.grad = grads[2].clone(), grads[2].clone()
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_routing_places_every_flash_tiny_parameter(tiny_cfg, tiny_model):
    from flashtrain.train.config import compose, optim_config
    from flashtrain.train.optim import route_parameters

    ocfg = optim_config(compose(["+exp=flash_tiny"]))
    groups = route_parameters(tiny_model, tiny_cfg, ocfg)
    placed = {n: g for g in groups for n in g.names}
    assert set(placed) == {n for n, _ in tiny_model.named_parameters()}
    assert sum(len(g.names) for g in groups) == len(placed)  # each exactly once
    rule = {n: g.rule for n, g in placed.items()}
    # literal expectations from V41_SPEC §7
    assert rule["embed.weight"] == rule["head.weight"] == "sinkhorn"
    assert rule["layers.1.engram.embed.weight"] == rule["layers.14.engram.embed.weight"] == "sinkhorn_engram"
    assert placed["layers.1.engram.embed.weight"].lr_mult == 5.0
    assert rule["layers.0.attn.wq_b.weight"] == "muon_q_heads"
    assert placed["layers.0.attn.wq_b.weight"].options["num_heads"] == tiny_cfg.n_heads
    assert rule["layers.24.attn.indexer.wq_b.weight"] == "muon_index_heads"
    assert placed["layers.24.attn.indexer.wq_b.weight"].options["num_heads"] == tiny_cfg.index_n_heads
    for n in ("layers.3.attn.wkv.weight", "layers.2.attn.compressor.wgate.weight", "layers.2.attn.indexer.wk.weight",
              "layers.0.ffn.experts.w2", "layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.gate.weight",
              "layers.1.engram.wkv.weight", "aligner.w1.weight", "layers.0.attn.wo_a.weight", "layers.0.hc_attn_fn"):
        assert rule[n] == "muon", n
    for n in ("norm.weight", "layers.0.attn_norm.weight", "layers.0.attn.q_norm.weight",
              "layers.2.attn.indexer.k_norm.weight", "layers.2.attn.compressor.norm.weight", "vision.norm.weight",
              "vision.blocks.0.norm1.weight"):
        assert rule[n] == "adamw_norm" and placed[n].options["weight_decay"] == 0.1, n
    for n in ("layers.0.attn.attn_sink", "layers.0.hc_ffn_base", "layers.0.hc_attn_scale", "aligner.w1.bias",
              "layers.1.engram.q_weight", "image_start"):
        assert rule[n] == "adamw" and placed[n].options["weight_decay"] == 0.0, n
    assert placed["vision.blocks.0.attn.wqkv.weight"].lr_mult == ocfg.vision_lr_mult
    assert placed["aligner.w1.weight"].lr_mult == 1.0 and placed["vision.norm.weight"].lr_mult == 1.0
    # MoE selection biases are buffers, in no optimizer
    assert "layers.0.ffn.gate.bias" not in placed


def test_routing_rejects_an_unknown_parameter(tiny_cfg, tiny_model):
    from flashtrain.train.config import compose, optim_config
    from flashtrain.train.optim import RoutingError, route_parameters

    tiny_model.register_parameter("mystery", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(RoutingError, match="'mystery'"):
        route_parameters(tiny_model, tiny_cfg, optim_config(compose(["+exp=flash_tiny"])))


@pytest.mark.slow
def test_optimizer_set_trains_flash_tiny_and_round_trips(tiny_cfg, tmp_path):
    from flashtrain.model import Transformer
    from flashtrain.train.checkpoint import CheckpointWriter, load_checkpoint
    from flashtrain.train.config import compose, optim_config
    from flashtrain.train.optim import build_optimizers

    ocfg = optim_config(compose(["+exp=flash_tiny"]))
    torch.manual_seed(0)
    model = Transformer(tiny_cfg)
    opt = build_optimizers(model, tiny_cfg, ocfg, lr=3e-3)
    assert set(opt.optimizers) == {"muon", "sinkhorn", "adamw"}
    tokens = torch.randint(3, 400, (2, 64))

    def step(m, o):
        o.zero_grad()
        logits = m(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, tiny_cfg.vocab_size),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
        o.step()
        return loss.item()

    losses = [step(model, opt) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses  # memorising one batch
    # through a checkpoint on disk, as the trainer writes and resumes it (train/checkpoint.py)
    saved = CheckpointWriter(tmp_path, keep=1).save(4, model, opt.optimizers, {"step": 4}, {})
    twin = Transformer(tiny_cfg)
    twin_opt = build_optimizers(twin, tiny_cfg, ocfg, lr=3e-3)
    load_checkpoint(saved, twin, twin_opt.optimizers)
    for _ in range(2):
        assert step(model, opt) == step(twin, twin_opt)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def test_sinkhorn_step_has_no_m_by_n_workspace():
    """Measured by tensor allocations (not RSS): beyond its momentum buffer the step allocates only
    chunk-sized temporaries, while a step that materialises U (literal Algorithm 1) allocates m x n."""
    from flashtrain.train.optim.memory import PeakTensorBytes

    m, n, chunk = 2048, 256, 1 << 13
    table = m * n * 4
    W = torch.nn.Parameter(torch.randn(m, n))
    W.grad = torch.randn(m, n)
    with PeakTensorBytes() as meter:
        SinkhornBalanced([W], lr=1e-3, chunk_elems=chunk).step()
    workspace = meter.peak - table  # the momentum buffer is the one m x n allocation
    assert 0 < workspace <= 6 * chunk * 4 + 4 * (m + n) * 4, workspace
    with PeakTensorBytes() as meter:
        with torch.no_grad():
            literal_algorithm_1(W.detach(), W.grad, torch.zeros(m, n), lr=1e-3)
    assert meter.peak >= 2 * table  # the meter does see m x n temporaries


def test_optim_config_validation_names_the_field():
    from flashtrain.config.errors import ConfigError
    from flashtrain.train.config import compose, optim_config

    for override, field in (("optim.sinkhorn.num_steps=10", "optim.sinkhorn.num_steps=10"),
                            ("optim.muon.ns_dtype=float16", "optim.muon.ns_dtype='float16'"),
                            ("+optim.lr=1e-3", "optim.lr=0.001: removed, the LR schedule is the only source")):
        with pytest.raises(ConfigError, match=re.escape(field)):
            optim_config(compose(["+exp=flash_tiny", override]))
    cfg = optim_config(compose(["+exp=flash_tiny"]))
    assert cfg.muon.coefficients() == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2


def test_removed_muon_distributed_key_names_what_to_set():
    """optim.muon.distributed is gone (ZeRO-1 is the one Newton-Schulz split): the key is refused with
    the setting that replaces it, not ignored."""
    from flashtrain.config.errors import ConfigError
    from flashtrain.train.config import compose, optim_config

    with pytest.raises(ConfigError, match=re.escape("optim.muon.distributed=True: removed") + ".*optim.zero=true"):
        optim_config(compose(["+exp=flash_tiny", "+optim.muon.distributed=true"]))


@pytest.mark.slow
def test_distributed_muon_and_row_sharded_sinkhorn_match_single_rank():
    """Two gloo ranks split the Newton-Schulz work of the 304 Muon matrices of flash_tiny's 8-layer plan
    (tests/parity_batch.py) by whole matrices (ZeRO-1 ownership, each piece broadcast by its owner): the
    parameters after two steps equal single-rank Muon's. And a table row-sharded over the two ranks gets
    the whole table's Sinkhorn update."""
    import sys
    from pathlib import Path

    import warm_launch

    root = Path(__file__).resolve().parent.parent
    run = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(root / "tests" / "dist" / "optimizer_parity.py")],
                           cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stdout.count("distributed Muon matches single-rank Muon on 304 matrices") == 2
    assert run.stdout.count("row-sharded Sinkhorn matches the whole table") == 2


def test_bench_optim_states_threads_and_load_with_its_figures():
    """launch/bench_optim.py's `run` (the function check_gpu.py would call with device="cuda") on flash_tiny's
    tables, one round, on the CPU: the figures come with the thread count and the machine's load, and ratios
    by wall-clock and CPU time."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
    import bench_optim

    threads = torch.get_num_threads()
    try:
        r = bench_optim.run(["+exp=flash_tiny"], rounds=1, threads=1, device="cpu", sections=("sinkhorn",))
    finally:
        torch.set_num_threads(threads)
    assert r["threads"] == 1 and r["device"] == "cpu"
    load = r["load"]["sinkhorn"]
    assert load["cpus_usable"] >= 1 and len(load["loadavg_start"]) == 3
    assert set(r["comparisons"]) == set(r["comparisons_cpu"]) == {"sinkhorn_vs_adamw", "sinkhorn_keep_grad_vs_adamw"}
    assert r["sinkhorn_time_ratio"] > 0 and "muon_time_ratio" not in r
    assert "tasks running" in bench_optim.table(r)
    # the trainer's chunk (conf/optim/v41.yaml optim.sinkhorn.chunk_elems), not the class default
    r2 = bench_optim.run(["+exp=flash_tiny", "optim.sinkhorn.chunk_elems=4096"], rounds=1, threads=1, device="cpu",
                         sections=("sinkhorn",))
    torch.set_num_threads(threads)
    assert r["sinkhorn_chunk_elems"] == 262144 and r2["sinkhorn_chunk_elems"] == 4096
    assert f"({r2['sinkhorn_params']:,} parameters, chunks of 4,096 values)" in bench_optim.table(r2)


def _bench_module(name: str):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
    return __import__(name)


def test_alternate_times_each_run_by_wall_clock_and_cpu_after_its_warm_up(monkeypatch):
    """launch/bench_util.py `alternate` on fake clocks: run "a" costs 10 s wall and 1 s CPU a call, "b" 20 s and
    2 s, and the warm-up round 100 s / 50 s each -- which must appear in neither list."""
    bench_util = _bench_module("bench_util")
    clock = {"wall": 0.0, "cpu": 0.0, "calls": 0}
    monkeypatch.setattr(bench_util.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(bench_util.time, "process_time", lambda: clock["cpu"])

    def run(wall, cpu):
        def call():
            warm = clock["calls"] < 2  # the first round calls each run once
            clock["calls"] += 1
            clock["wall"] += 100.0 if warm else wall
            clock["cpu"] += 50.0 if warm else cpu
        return call

    cpu: dict = {}
    times = bench_util.alternate({"a": run(10.0, 1.0), "b": run(20.0, 2.0)}, rounds=3, warmup=1,
                                 sync=lambda: None, cpu_times=cpu)
    assert times == {"a": [10.0] * 3, "b": [20.0] * 3}
    assert cpu == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_bench_optim_ratios_put_ours_over_the_baseline_by_wall_clock_and_cpu(monkeypatch):
    """bench_optim's Sinkhorn section on hand-set timings (alternate replaced): wall ratios sinkhorn / adamw =
    0.5, 0.75, 1.0 per round, CPU ratios 0.25 each; keep-grad wall 2.0 each -> medians 0.75 / 0.25 / 2.0, and
    the medians of the step times."""
    bench_optim = _bench_module("bench_optim")
    wall = {"sinkhorn": [1.0, 1.5, 2.0], "sinkhorn_keep_grad": [4.0, 4.0, 4.0], "adamw": [2.0, 2.0, 2.0]}
    cpu_s = {"sinkhorn": [0.5, 0.5, 0.5], "sinkhorn_keep_grad": [1.0, 1.0, 1.0], "adamw": [2.0, 2.0, 2.0]}

    def fake_alternate(runs, rounds, cpu_times=None, **kw):
        assert set(runs) == set(wall) and rounds == 3
        for step in runs.values():  # one real step each: the optimizers' state exists, as after the warm-up
            step()
        cpu_times.update({k: list(v) for k, v in cpu_s.items()})
        return {k: list(v) for k, v in wall.items()}

    monkeypatch.setattr(bench_optim, "alternate", fake_alternate)
    threads = torch.get_num_threads()
    try:
        r = bench_optim.run(["+exp=flash_tiny"], rounds=3, threads=1, device="cpu", sections=("sinkhorn",))
    finally:
        torch.set_num_threads(threads)
    assert r["comparisons"]["sinkhorn_vs_adamw"]["ratios"] == [0.5, 0.75, 1.0]
    assert r["sinkhorn_time_ratio"] == 0.75 and r["sinkhorn_keep_grad_time_ratio"] == 2.0
    assert r["comparisons_cpu"]["sinkhorn_vs_adamw"]["median"] == 0.25
    assert r["comparisons_cpu"]["sinkhorn_keep_grad_vs_adamw"]["median"] == 0.5
    assert (r["sinkhorn_step_s"], r["adamw_step_s"], r["sinkhorn_keep_grad_step_s"]) == (1.5, 2.0, 4.0)
    assert r["cpu_times_s"] == {"sinkhorn": 0.5, "sinkhorn_keep_grad": 1.0, "adamw": 2.0}
