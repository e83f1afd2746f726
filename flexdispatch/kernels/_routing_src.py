"""Triton sources of the fused routing kernels (forward and backward); launched by ``routing.py``.

Shape letters: T tokens · E experts · k top-k · G expert groups of X experts; ``*_PAD`` the next
power of two. Imported only when ``triton`` imports.

Selection works on 32-bit integer keys that order like the fp32 selection scores, with the
project's tie rule built in: ``-0.0`` counts as ``+0.0``, NaN ranks above ``+inf`` (torch.topk's
rule) and every NaN is equal, masked-out experts rank below ``-inf``; among equal keys the lower
expert (or group) id wins, because the index of a maximum is taken as the minimum index holding it.
"""

# NOTE: no ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr``
# annotations of the kernels' parameters as objects. Branches on constexprs stay plain if-blocks
# (resolved when the kernel is compiled), hence the SIM rules off.
# ruff: noqa: SIM102, SIM108
import triton.language as tl

_KEY_MIN = tl.constexpr(-2147483648)  # below every score's key (masked experts / groups)
_KEY_NAN = tl.constexpr(2147483647)  # every NaN


def route_fwd(
    logits_ptr,
    bias_ptr,
    idx_ptr,
    probs_ptr,
    T,
    stride_t,
    scaling,
    G: tl.constexpr,
    X: tl.constexpr,
    G_PAD: tl.constexpr,
    X_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
    NSUM: tl.constexpr,
    SCORE: tl.constexpr,
    PRE: tl.constexpr,
    FULL_SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    VALUE_FROM_KEY: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``BLOCK_T`` rows of ``logits [T, E]`` -> ``idx [T, K]`` int64 and ``probs [T, K]`` fp32.

    SCORE: 0 softmax, 1 sigmoid, 2 sqrtsoftplus. PRE: softmax before the top-k. FULL_SOFTMAX:
    the full softmax is needed (PRE, or softmax-post without renormalisation). G > 1: group-
    limited top-k, groups ranked by the sum of their NSUM best selection scores (NSUM = 1 is the
    max rule), GROUP_TOPK kept. The experts are laid out ``[G_PAD, X_PAD]``, expert ``g*X + x``.
    VALUE_FROM_KEY: the probs' source is the selection score itself, so a chosen value is read
    back from its key instead of looked up.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    gi = tl.arange(0, G_PAD)
    xi = tl.arange(0, X_PAD)
    col_ok = (gi[:, None] < G) & (xi[None, :] < X)
    cols = gi[:, None] * X + xi[None, :]
    ok3 = row_ok[:, None, None] & col_ok[None, :, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None, None] * stride_t + cols[None, :, :]
    x = tl.load(ptrs, mask=ok3, other=0.0).to(tl.float32)
    # NOTE: padding experts are -inf (nothing in softmax sums); rows past T stay finite (0).
    x = tl.where(col_ok[None, :, :], x, float("-inf"))

    if SCORE == 0:
        if FULL_SOFTMAX:
            m = tl.max(tl.max(x, axis=2), axis=1)
            ex = tl.exp(x - m[:, None, None])
            den = tl.sum(tl.sum(ex, axis=2), axis=1)
            s = ex / den[:, None, None]
            if PRE:
                sel = s
            else:
                sel = x
        else:
            sel = x
    else:
        if SCORE == 1:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            # sqrt(softplus(x)), softplus with torch's threshold 20 and an accurate log1p
            u = tl.exp(x)
            w = 1.0 + u
            lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
            s = tl.sqrt(tl.where(x > 20.0, x, lp))
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            sel = s + b[None, :, :]
        else:
            sel = s

    # Order-preserving integer keys of the selection scores (see the module docstring).
    selz = tl.where(sel == 0.0, 0.0, sel)
    bits = selz.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(selz != selz, _KEY_NAN, key)
    key = tl.where(col_ok[None, :, :], key, _KEY_MIN)

    if G > 1:
        # Group score: the NSUM largest selection scores of each group, added largest first.
        work = key
        gsum = tl.zeros([BLOCK_T, G_PAD], dtype=tl.float32)
        for n in tl.static_range(NSUM):
            mk, at = tl.max(work, axis=2, return_indices=True, return_indices_tie_break_left=True)
            hit = xi[None, None, :] == at[:, :, None]
            vb = tl.where(mk >= 0, mk, mk ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            if n == 0:
                gsum = vb
            else:
                gsum = gsum + vb
            work = tl.where(hit, _KEY_MIN, work)
        gz = tl.where(gsum == 0.0, 0.0, gsum)
        gbits = gz.to(tl.int32, bitcast=True)
        gkey = tl.where(gbits < 0, gbits ^ 0x7FFFFFFF, gbits)
        gkey = tl.where(gz != gz, _KEY_NAN, gkey)
        gkey = tl.where(gi[None, :] < G, gkey, _KEY_MIN)
        kept = gkey != gkey  # all False, [BLOCK_T, G_PAD]
        for _ in tl.static_range(GROUP_TOPK):
            _, ag = tl.max(gkey, axis=1, return_indices=True, return_indices_tie_break_left=True)
            hg = gi[None, :] == ag[:, None]
            kept = kept | hg
            gkey = tl.where(hg, _KEY_MIN, gkey)
        key = tl.where(kept[:, :, None], key, _KEY_MIN)

    # The top-k over the flattened [G_PAD * X_PAD] positions (position order = expert order).
    key2 = tl.reshape(key, [BLOCK_T, G_PAD * X_PAD])
    pos = tl.arange(0, G_PAD * X_PAD)
    kk = tl.arange(0, K_PAD)
    kmask = kk[None, :] < K
    out_idx = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    out_v = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        mk, at = tl.max(key2, axis=1, return_indices=True, return_indices_tie_break_left=True)
        e = (at // X_PAD) * X + at % X_PAD
        out_idx = tl.where(kk[None, :] == j, e[:, None], out_idx)
        if VALUE_FROM_KEY:
            v = tl.where(mk >= 0, mk, mk ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            out_v = tl.where(kk[None, :] == j, v[:, None], out_v)
        key2 = tl.where(pos[None, :] == at[:, None], _KEY_MIN, key2)
    if not VALUE_FROM_KEY:
        # the probs' source at the chosen experts, recomputed from their logits by the same
        # formulas as the tile (a gather of k values per row instead of k lookups in registers)
        xs = tl.load(
            logits_ptr + rows.to(tl.int64)[:, None] * stride_t + out_idx,
            mask=row_ok[:, None] & kmask,
            other=0.0,
        ).to(tl.float32)
        if SCORE == 0:
            out_v = tl.exp(xs - m[:, None]) / den[:, None]
        elif SCORE == 1:
            out_v = 1.0 / (1.0 + tl.exp(-xs))
        else:
            u = tl.exp(xs)
            w = 1.0 + u
            lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
            out_v = tl.sqrt(tl.where(xs > 20.0, xs, lp))

    p = out_v
    if SCORE == 0:
        if not PRE:
            if not FULL_SOFTMAX:
                vm = tl.where(kmask, out_v, float("-inf"))
                mx = tl.max(vm, axis=1)
                ek = tl.exp(vm - mx[:, None])
                p = ek / tl.sum(ek, axis=1)[:, None]
    if NORMALIZE:
        p = p / (tl.sum(tl.where(kmask, p, 0.0), axis=1)[:, None] + 1e-20)
    if HAS_SCALING:
        p = p * scaling
    out_off = rows.to(tl.int64)[:, None] * K + kk[None, :]
    omask = row_ok[:, None] & kmask
    tl.store(idx_ptr + out_off, out_idx.to(tl.int64), mask=omask)
    tl.store(probs_ptr + out_off, p, mask=omask)


def route_bwd(
    logits_ptr,
    idx_ptr,
    grad_ptr,
    dx_ptr,
    T,
    stride_t,
    scaling,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SCORE: tl.constexpr,
    PRE: tl.constexpr,
    FULL_SOFTMAX: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``d probs [T, K]`` -> ``d logits [T, E]`` (dense, fp32) for ``route_fwd``.

    Recomputes the scores of the chosen experts from the logits (the whole row only when the full
    softmax is needed); the chain is torch's autograd of the torch path, written out.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, K_PAD)
    kmask = kk[None, :] < K
    kok = row_ok[:, None] & kmask
    idx = tl.load(idx_ptr + rows64[:, None] * K + kk[None, :], mask=kok, other=0)
    g = tl.load(grad_ptr + rows64[:, None] * K + kk[None, :], mask=kok, other=0.0).to(tl.float32)
    if HAS_SCALING:
        g = g * scaling
    xs = tl.load(logits_ptr + rows64[:, None] * stride_t + idx, mask=kok, other=0.0).to(tl.float32)
    cols = tl.arange(0, E_PAD)
    ok2 = row_ok[:, None] & (cols[None, :] < E)
    dx_row = dx_ptr + rows64[:, None] * E

    if FULL_SOFTMAX:
        # softmax over all E (pre-softmax, or post without renormalisation): a dense gradient
        # s * (G - <G, s>) with G the chosen experts' gradients
        x = tl.load(logits_ptr + rows64[:, None] * stride_t + cols[None, :], mask=ok2, other=0.0)
        x = tl.where(cols[None, :] < E, x.to(tl.float32), float("-inf"))
        m = tl.max(x, axis=1)
        ex = tl.exp(x - m[:, None])
        den = tl.sum(ex, axis=1)
        s = ex / den[:, None]
        s_sel = tl.where(kmask, tl.exp(xs - m[:, None]) / den[:, None], 0.0)
        if NORMALIZE:
            d = tl.sum(s_sel, axis=1) + 1e-20
            c = -tl.sum(g * s_sel / (d * d)[:, None], axis=1)
            g = g / d[:, None] + c[:, None]
        g = tl.where(kmask, g, 0.0)
        dot = tl.sum(g * s_sel, axis=1)
        base = (0.0 - dot[:, None]) * s
        gsel = (g - dot[:, None]) * s_sel
    else:
        base = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
        if SCORE == 0:
            # softmax over the k chosen logits
            vm = tl.where(kmask, xs, float("-inf"))
            mx = tl.max(vm, axis=1)
            ek = tl.exp(vm - mx[:, None])
            p = ek / tl.sum(ek, axis=1)[:, None]
            dot = tl.sum(g * p, axis=1)
            gsel = (g - dot[:, None]) * p
        else:
            if SCORE == 1:
                s_sel = 1.0 / (1.0 + tl.exp(-xs))
            else:
                u = tl.exp(xs)
                w = 1.0 + u
                lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
                s_sel = tl.sqrt(tl.where(xs > 20.0, xs, lp))
            s_sel = tl.where(kmask, s_sel, 0.0)
            if NORMALIZE:
                d = tl.sum(s_sel, axis=1) + 1e-20
                c = -tl.sum(g * s_sel / (d * d)[:, None], axis=1)
                g = g / d[:, None] + c[:, None]
            if SCORE == 1:
                gsel = g * (1.0 - s_sel) * s_sel
            else:
                # d sqrt(y) = 1 / (2 sqrt(y)); d softplus(x) = sigmoid(x), 1 past the threshold
                u = tl.exp(xs)
                dsp = tl.where(xs > 20.0, 1.0, u / (u + 1.0))
                gsel = g / (2.0 * tl.where(kmask, s_sel, 1.0)) * dsp
    # The row's value off the chosen experts (0, or -dot * s), then the chosen experts' own:
    # the barrier orders the two stores to the same addresses within the program.
    tl.store(dx_row + cols[None, :], base, mask=ok2)
    tl.debug_barrier()
    tl.store(dx_row + idx, gsel, mask=kok)
