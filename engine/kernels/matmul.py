"""Matrix products (shaders/matmul.wgsl) and the linear layer built on them.

A linear layer computes Y[M, N] = X[M, K] W[N, K]^T + b.  Its backward is three more
products of the same kernel: dX = dY W, dW += dY^T X, db += 1^T dY.

An operand larger than one storage binding (an LM head or embedding table, activations of a
long batch) splits the product into blocks of rows (M), columns (N) and, where only that
helps, the reduction (K, accumulated): `_split_call`.
"""

from __future__ import annotations

import numpy as np
from memengine.engine.kernels.lanes import cpu_lanes
from memengine.engine.runtime import (
    BindingError,
    KernelSettings,
    Recorder,
    Tensor,
    bound,
    cdiv,
    fits_all,
    fmt_bytes,
    pack,
    span,
)

# `rt.kernels.matmul` (MEMENGINE_MATMUL): "reference" forces the plain kernel everywhere (the
# fast ones must match it); "nosplit" turns split-K off; "tiles" keeps matmul_fast where
# matmul_lanes would run

# matmul_fast's tile configuration (its pipeline constants): BM x BN of C per workgroup of
# (BM/8)*(BN/8) threads, K in steps of BK; see shaders/matmul.wgsl.
BASE = dict(BM=128, BN=128, BK=16)
# the entry points of --precision mixed's products: matmul_f16 (shaders/matmul_f16.wgsl) and,
# where the adapter has f16 subgroup matrices, matmul_sgmat (shaders/matmul_sgmat.wgsl)
F16_ENTRIES = ("matmul_f16", "matmul_sgmat")
# `rt.kernels.matmul_tiles`: a dict or a function (rt, M, N, K) -> dict forcing the
# configuration (tests, benchmarks)


def _settings(rt) -> KernelSettings:
    """The runtime's kernel switches; the environment's for the stand-ins the sizing
    helpers also take (a plan's limits, anything with `max_binding`)."""
    k = getattr(rt, "kernels", None)
    return k if k is not None else KernelSettings.from_env()


def valid_config(c: dict) -> bool:
    """The shader's constraints: 8x8 blocks per thread, at most 256 threads, each thread
    loading at most four vec4 of each operand's tile, tiles of at most 128 x 128."""
    nt = (c["BM"] // 8) * (c["BN"] // 8)
    na, nb = c["BK"] * c["BM"] // 4, c["BK"] * c["BN"] // 4
    return (c["BM"] % 8 == 0 and c["BN"] % 8 == 0 and c["BK"] % 8 == 0 and nt <= 256
            and na <= 4 * nt and nb <= 4 * nt and c["BM"] <= 128 and c["BN"] <= 128)


def fast_config(rt, M: int, N: int, K: int) -> dict:
    """The tile configuration of matmul_fast for one product on this adapter.

    Measured on the H200 (benchmarks/README.md): 128x128 tiles, BK 16 everywhere except
    few rows (x_proj's weight gradient, M = 80: BM = M rounded up to 8, 1.3x) and few
    columns (dt_proj's weight and input gradients, N = 48: BN 64, 1.5x and 1.2x)."""
    force = _settings(rt).matmul_tiles
    if force is not None:
        c = force(rt, M, N, K) if callable(force) else force
        c = {**BASE, **c}
    else:
        c = dict(BASE)
        if M <= 96:
            c["BM"] = max(64, -(-M // 8) * 8)
        elif N <= 64:
            c["BN"] = 64
    assert valid_config(c), c
    return c


def _fast_ok(mode, M, N, K, trans_a, trans_b, lda, ldb, ldc, a_col, b_col, c_col, tensors) -> bool:
    if mode == "reference" or K % 4 or N % 4 or ldc % 4 or c_col % 4:
        return False
    if any(t.offset % 16 for t in tensors if t is not None):
        return False
    if lda % 4 or a_col % 4 or (trans_a and M % 4):
        return False
    if ldb % 4 or b_col % 4:
        return False
    return True


def _rounds(blocks: int) -> float:
    """Time of `blocks` equal workgroups, in rounds of a full GPU: the busiest SM gets
    cdiv(blocks, _SMS) of them; two share an SM, and one alone takes _LONE of a pair's time."""
    c = cdiv(blocks, _SMS)
    return c // 2 + _LONE * (c % 2)


def _split_cost(M: int, N: int, K: int, tiles: int, tile_elems: int, s: int, bk: int,
                round_k_s: float | None = None) -> float:
    """Estimated seconds of the product in s K-slices (whole BK tiles each) plus, when split,
    the reduce (reading the partial products; their stores overlap the product's arithmetic).
    `round_k_s`: a kernel that runs _SGMAT_PER_SM workgroups an SM (matmul_sgmat), with the
    seconds of one K step of a full round of them; None: matmul_fast's two an SM
    (`_rounds`)."""
    ks = cdiv(cdiv(K, s), bk) * bk
    if round_k_s is None:
        t = _rounds(tiles * cdiv(K, ks)) * ks * _ROUND_K_S * tile_elems / (128 * 128)
    else:
        t = cdiv(tiles * cdiv(K, ks), _SMS * _SGMAT_PER_SM) * ks * round_k_s
    if s > 1:
        t += 4.0 * cdiv(K, ks) * M * N / _BYTES_S + _LAUNCH_S
    return t


def _split_k(rt, M: int, N: int, K: int, tiles: int, tile_elems: int = 128 * 128, bk: int = 16,
             round_k_s: float | None = None) -> int:
    """How many K slices to use: the count of the cheapest estimate (`_split_cost`) among
    slices of at least _MIN_SLICE_K, at most 64, whose partial products fit one binding;
    the smaller count where estimates are within 0.5%.  Few output tiles leave SMs idle or
    alone (the weight gradients: 12-144 tiles of 264 places); a count of workgroups that
    fills the last round is what the estimate favours."""
    if _settings(rt).matmul == "nosplit" or K < 2 * _MIN_SLICE_K:
        return 1
    cap = min(rt.max_binding, 256 * 2**20)
    best, best_t = 1, _split_cost(M, N, K, tiles, tile_elems, 1, bk, round_k_s)
    for s in range(2, min(64, K // _MIN_SLICE_K) + 1):
        if 4 * s * M * N > cap:
            break
        t = _split_cost(M, N, K, tiles, tile_elems, s, bk, round_k_s)
        if t < 0.995 * best_t:
            best, best_t = s, t
    return best


def splitk_slices(rt, M: int, N: int, K: int) -> tuple[int, int]:
    """(slices, K per slice) of the fast kernel's split-K path for an M x N x K product;
    (1, K) when it does not split.  Slices are whole BK tiles; the partial products
    (slices x M x N) fit one binding (`_split_k`)."""
    cfg = fast_config(rt, M, N, K)
    s = _split_k(rt, M, N, K, cdiv(N, cfg["BN"]) * cdiv(M, cfg["BM"]), cfg["BM"] * cfg["BN"], cfg["BK"])
    if s <= 1:
        return 1, K
    ks = cdiv(cdiv(K, s), cfg["BK"]) * cfg["BK"]   # a whole number of BK tiles
    return cdiv(K, ks), ks


# The split-K estimate's H200 figures (fp32, 128x128 tiles, BK 16; benchmarks/results/h200/
# diagnostics/splitk_probe.txt): 132 SMs, two workgroups resident on each; a round of 264 workgroups
# takes 0.2134 us per step of K (0.874 ms at K 4096); 132 alone take 0.58 of that.
_SMS = 132
_LONE = 0.58
_ROUND_K_S = 0.874e-3 / 4096
_BYTES_S = 3e12        # the reduce reading the partial products
_LAUNCH_S = 4e-6       # the reduce's dispatch
_MIN_SLICE_K = 256
# matmul_sgmat (128 x 128 tiles of 128 invocations, two workgroups an SM: the registers of 4
# subgroups' 64 x 64 results allow two): a K step of a full round of workgroups, from the H100
# (results/h100/sgmat_wg128/: in_proj's input gradient, 768 tiles = 3 rounds, K 3072, 179.9
# TFLOP/s = 0.430 ms unsplit)
_SGMAT_PER_SM = 2
_SGMAT_ROUND_K_S = 0.430e-3 / (3 * 3072)


def matmul(rec: Recorder, C: Tensor, A: Tensor, B: Tensor, *, M: int, N: int, K: int,
           trans_a: bool = False, trans_b: bool = False,
           lda: int | None = None, ldb: int | None = None, ldc: int | None = None,
           a_col: int = 0, b_col: int = 0, c_col: int = 0,
           acc: bool = False, bias: Tensor | None = None,
           A16: Tensor | None = None, B16: Tensor | None = None) -> None:
    """C[:, c_col:c_col+N] (+)= op(A) @ op(B) (+ bias).

    Without transposes A is stored [M, lda] and B is stored [K, ldb]; with trans_a A is
    stored [K, lda] (we use its transpose), with trans_b B is stored [N, ldb].
    `a_col`/`b_col`/`c_col` select a column slice of the stored matrix.
    `A16`/`B16` (--precision mixed): f16 copies of A and B in the same layout; when both
    are given and the shape suits the fast kernel, shaders/matmul_f16.wgsl multiplies
    them (f32 accumulation) instead of A and B.
    """
    if M == 0 or N == 0:
        return
    if not rec.rt.unsplit and _split_call(rec, C, A, B, M, N, K, trans_a, trans_b, lda, ldb, ldc,
                                          a_col, b_col, c_col, acc, bias, A16, B16):
        return
    # views at any offset: bind from the aligned offset below and shift the indices
    rt = rec.rt
    mode = rt.kernels.matmul
    scales = operand_scales(A16, B16) if A16 is not None and B16 is not None else None
    shader, A, B, a_col, b_col = _operands(rt, mode, C, A, B, A16, B16, M, N, K, trans_a, trans_b, lda, ldb, ldc,
                                           a_col, b_col, c_col, bias)
    C, ec = bound(rt, C)
    c_col += ec
    bias_off = 0
    if bias is not None:
        bias, bias_off = bound(rt, bias)
    if not trans_a:
        lda = K if lda is None else lda
        a_rs, a_cs = lda, 1
    else:
        lda = M if lda is None else lda
        a_rs, a_cs = 1, lda
    if not trans_b:
        ldb = N if ldb is None else ldb
        b_rs, b_cs = ldb, 1
    else:
        ldb = K if ldb is None else ldb
        b_rs, b_cs = 1, ldb
    ldc = N if ldc is None else ldc
    if shader == "matmul_f16" or _fast_ok(mode, M, N, K, trans_a, trans_b, lda, ldb, ldc, a_col, b_col, c_col,
                                          (A, B, C, bias)):
        _record_tiled(rec, shader, mode, C, A, B, bias, M, N, K, trans_a, trans_b, acc,
                      (a_col, lda, b_col, ldb, c_col, ldc, bias_off), scales)
        return
    # the plain 64x64 kernel: any shape, strides as given
    flags = (1 if acc else 0) | (2 if bias is not None else 0) | (4 if a_cs == 1 else 0) | (8 if b_cs == 1 else 0)
    u = rec.rt.uniform(pack("16I", M, N, K, flags, a_col, a_rs, a_cs, b_col,
                            b_rs, b_cs, c_col, ldc, bias_off, 0, 0, 0))
    if shader == "matmul" and mode not in ("reference", "tiles") and cpu_lanes(rt):
        # CPU adapters: matmul_lanes' tile with scalar loads, for the shapes it does not take
        rec.dispatch("matmul", "matmul_lanes_any", {0: C, 1: A, 2: B, 3: bias if bias is not None else A, 4: u},
                     (cdiv(N, 32), cdiv(M, 32), 1), {"ACC": int(acc), "BIAS": int(bias is not None)})
        return
    rec.dispatch("matmul", "matmul_forward",
                 {0: C, 1: A, 2: B, 3: bias if bias is not None else A, 4: u},
                 (cdiv(N, 64), cdiv(M, 64), 1))


def _operands(rt, mode, C, A, B, A16, B16, M, N, K, trans_a, trans_b, lda, ldb, ldc, a_col, b_col, c_col, bias):
    """(shader, A, B, a_col, b_col) bound for the product: the f16 copies and matmul_f16
    when both are given and the shape suits the fast kernel, else the f32 operands."""
    if A16 is not None and B16 is not None and mode != "reference":
        A16b, ea16 = bound(rt, A16)
        B16b, eb16 = bound(rt, B16)
        C16, ec16 = bound(rt, C)
        lda16 = (K if not trans_a else M) if lda is None else lda
        ldb16 = (N if not trans_b else K) if ldb is None else ldb
        if _fast_ok(mode, M, N, K, trans_a, trans_b, lda16, ldb16, N if ldc is None else ldc,
                    a_col + ea16, b_col + eb16, c_col + ec16, (C16, bias)):
            return "matmul_f16", A16b, B16b, a_col + ea16, b_col + eb16
    A, ea = bound(rt, A)
    B, eb = bound(rt, B)
    return "matmul", A, B, a_col + ea, b_col + eb


def f16_split(rt, M: int, N: int, K: int, c_bytes: int | None = None) -> tuple[str, int, int]:
    """(shader, slices, K per slice) of an f16 product M x N x K (`c_bytes`: its result's
    bytes, 4 M N if not given): matmul_sgmat where the adapter has subgroup matrices and the
    result is large enough, else matmul_f16 (128 x 128 tiles, BK 16); split over K where that
    pays (`rt`: a Runtime or the memory plan's Limits)."""
    c_bytes = 4 * M * N if c_bytes is None else c_bytes
    sg = bool(getattr(rt, "has_subgroup_matrix", False) and rt.kernels.sgmat and c_bytes >= SGMAT_MIN_C_BYTES)
    (bm, bn), bk = (SGMAT_TILE, 32) if sg else ((128, 128), 16)
    slices = _split_k(rt, M, N, K, cdiv(N, bn) * cdiv(M, bm), bm * bn, bk, _SGMAT_ROUND_K_S if sg else None)
    ks = cdiv(cdiv(K, slices), bk) * bk if slices > 1 else K
    return ("matmul_sgmat" if sg else "matmul_f16"), cdiv(K, ks), ks


def _record_tiled(rec, shader, mode, C, A, B, bias, M, N, K, trans_a, trans_b, acc, layout,
                  scales=None) -> None:
    """The tiled kernels: matmul_lanes (CPU adapters), else matmul_fast / matmul_f16 (on
    subgroup matrices where the adapter has them: matmul_sgmat), split
    over K where that pays (partial products reduced into C).  `layout`: (a_col, lda, b_col,
    ldb, c_col, ldc, bias_off) as bound; `scales` (the f16 kernels): (scale table, A's slot,
    B's slot), which the epilogue undoes."""
    rt = rec.rt
    a_col, lda, b_col, ldb, c_col, ldc, bias_off = layout
    tab, sa, sb = {}, 0, 0
    if shader == "matmul_f16":
        table, sa, sb = scales if scales is not None else (unit_scales(rt), 0, 0)
        tab = {5: table}
    fflags = (1 if acc else 0) | (2 if bias is not None else 0) | (4 if trans_a else 0) | (8 if trans_b else 0)
    if shader == "matmul" and mode != "tiles" and cpu_lanes(rt):
        u = rt.uniform(pack("16I", M, N, K, fflags, a_col, lda, b_col, ldb, c_col, ldc, bias_off, 0, 0, 0, 0, 0))
        rec.dispatch("matmul", "matmul_lanes",
                     {0: C, 1: A, 2: B, 3: bias if bias is not None else B, 4: u},
                     (cdiv(N, 32), cdiv(M, 32), 1),
                     {"TA": int(trans_a), "TB": int(trans_b), "ACC": int(acc), "BIAS": int(bias is not None)})
        return
    if shader == "matmul_f16":   # on subgroup matrices (tensor cores) where they pay
        shader, slices, ks = f16_split(rt, M, N, K, C.nbytes)
    entry = shader if shader != "matmul" else "matmul_fast"
    if shader == "matmul_sgmat":   # the operands again as 16-byte words (its interior loads;
        # an operand under one word, which only the guarded path reads, binds a word of scratch)
        word = lambda t: t if t.nbytes >= 16 else rt.scratch("matmul_sgmat_word", (4,))
        tab = {**tab, 6: word(A), 7: word(B)}
    if shader == "matmul_f16":   # fixed tiles: 128x128, BK 16
        bm, bn, consts = 128, 128, None
    elif shader == "matmul_sgmat":   # its tile and the layouts as constants, BK 32
        bm, bn = SGMAT_TILE
        consts = {"TA": int(trans_a), "TB": int(trans_b)}
    else:
        cfg = fast_config(rt, M, N, K)
        consts = {k: int(v) for k, v in cfg.items()}
        consts.update(TA=int(trans_a), TB=int(trans_b))   # the layouts as constants
        consts.setdefault("OFFSETS", int(trans_a))   # the tile loads' form (shaders/matmul.wgsl)
        bm, bn = cfg["BM"], cfg["BN"]
        slices, ks = splitk_slices(rt, M, N, K)
    if slices > 1:
        part = rt.scratch("matmul_splitk", (slices * M * N,))
        u = rt.uniform(pack("16I", M, N, K, fflags, a_col, lda, b_col, ldb, 0, N, 0, ks, sa, sb, 0, 0))
        rec.dispatch(shader, entry, {0: part, 1: A, 2: B, 3: B, 4: u, **tab},
                     (cdiv(N, bn), cdiv(M, bm), slices), consts)
        u = rt.uniform(pack("16I", M, N, slices, fflags & 3, 0, 0, 0, 0, c_col, ldc, bias_off, 0, 0, 0, 0, 0))
        rec.dispatch("matmul", "matmul_splitk_reduce",
                     {0: C, 1: part, 3: bias if bias is not None else part, 4: u}, cdiv(M * N // 4, 256))
        return
    u = rt.uniform(pack("16I", M, N, K, fflags, a_col, lda, b_col, ldb, c_col, ldc, bias_off, 0, sa, sb, 0, 0))
    rec.dispatch(shader, entry,
                 {0: C, 1: A, 2: B, 3: bias if bias is not None else B, 4: u, **tab},
                 (cdiv(N, bn), cdiv(M, bm), 1), consts)


# matmul_sgmat stores 16 x 16 results from subgroup matrices, for which Dawn wants the binding of
# C to hold one (1 KiB); a smaller C takes matmul_f16
SGMAT_MIN_C_BYTES = 16 * 16 * 4


# matmul_sgmat's tile (BM, BN: the shader's constants), 4 subgroups, for every product; on an
# H100 it ran 1.00-1.12x the 128 x 256 and 256 x 128 tiles of 8 subgroups at each large
# product of the mamba-130m step (results/h100/sgmat_wg128/README.md)
SGMAT_TILE = (128, 128)


def _windows(m, n, k, trans_a, trans_b, lda, ldb, ldc, has_bias) -> dict:
    """Elements of each operand a block of m x n (reduction k) binds."""
    w = {"A": (k - 1) * lda + m if trans_a else (m - 1) * lda + k,
         "B": (n - 1) * ldb + k if trans_b else (k - 1) * ldb + n,
         "C": (m - 1) * ldc + n}
    if has_bias:
        w["bias"] = n
    return w


_DEPENDS = {"A": "mk", "B": "nk", "C": "mn", "bias": "n"}


def _half(d: int) -> int:
    h = cdiv(d, 2)
    r = cdiv(h, 128) * 128 if h > 128 else (cdiv(h, 4) * 4 if h > 4 else h)
    return r if r < d else h


def _split_call(rec, C, A, B, M, N, K, trans_a, trans_b, lda, ldb, ldc, a_col, b_col, c_col, acc, bias,
                A16=None, B16=None) -> bool:
    """Record the product as blocks when an operand does not fit one binding (False: it fits)."""
    rt = rec.rt
    if fits_all(rt):
        return False
    limit = rt.max_binding - (rt.storage_align - 4)
    if all(4 * t.numel <= limit for t in (A, B, C, bias) if t is not None):
        return False
    lda = (M if trans_a else K) if lda is None else lda
    ldb = (K if trans_b else N) if ldb is None else ldb
    ldc = N if ldc is None else ldc
    dims = {"m": M, "n": N, "k": K}

    def win(d):
        return _windows(d["m"], d["n"], d["k"], trans_a, trans_b, lda, ldb, ldc, bias is not None)

    while True:
        over = {op: 4 * e for op, e in win(dims).items() if 4 * e > limit}
        if not over:
            break
        op = max(over, key=over.get)
        best = None
        for d in _DEPENDS[op]:
            if dims[d] > 1:
                size = win({**dims, d: _half(dims[d])})[op]
                key = (size, d == "k")  # the smaller window; rows/columns before the reduction
                best = (key, d) if best is None or key < best[0] else best
        if best is None:
            raise BindingError(f"a {M}x{N}x{K} matrix product needs {fmt_bytes(over[op])} of one operand "
                               f"in one storage binding but the adapter allows {fmt_bytes(rt.max_binding)}")
        dims[best[1]] = _half(dims[best[1]])
    bm, bn, bk = dims["m"], dims["n"], max(dims["k"], 1)
    for m0 in range(0, M, bm):
        m = min(bm, M - m0)
        for n0 in range(0, N, bn):
            n = min(bn, N - n0)
            for k0 in range(0, K, bk):
                k = min(bk, K - k0)
                w = _windows(m, n, k, trans_a, trans_b, lda, ldb, ldc, False)
                a = span(A, a_col + (k0 * lda + m0 if trans_a else m0 * lda + k0), w["A"])
                b = span(B, b_col + (n0 * ldb + k0 if trans_b else k0 * ldb + n0), w["B"])
                c = span(C, c_col + m0 * ldc + n0, w["C"])
                a16 = b16 = None
                if A16 is not None and B16 is not None:   # the f16 copies share the layout
                    a16 = with_scale(span(A16, a_col + (k0 * lda + m0 if trans_a else m0 * lda + k0), w["A"]),
                                     scale_of(A16))
                    b16 = with_scale(span(B16, b_col + (n0 * ldb + k0 if trans_b else k0 * ldb + n0), w["B"]),
                                     scale_of(B16))
                matmul(rec, c, a, b, M=m, N=n, K=k, trans_a=trans_a, trans_b=trans_b, lda=lda, ldb=ldb,
                       ldc=ldc, acc=acc or k0 > 0,
                       bias=span(bias, n0, n) if bias is not None and k0 == 0 else None, A16=a16, B16=b16)
    return True


# --------------------------------------------------------------------- per-tensor f16 scales
# f16_rescale's rule (shaders/matmul_f16.wgsl): a tensor whose casts saw amax A (of the f32
# values) is cast next as x * 2^e, e = min(F16_TARGET_EXP - floor(log2 A), F16_EXP_MAX):
# the scaled amax lies in [2^12, 2^13), 8x below f16's largest value (65504) for growth until
# the next rescale; a zero or non-finite amax keeps e.  e <= F16_EXP_MAX (an amax below
# 2^-48 is not scaled up all the way); e >= 12 - 127 = F16_EXP_MIN for any finite amax, so any
# f32 magnitude fits.  Powers of two: scaling and the epilogue's undoing (2^-(ea + eb)) are
# exact, and with every e = 0 nothing changes.
F16_TARGET_EXP = 12
F16_EXP_MAX = 60
F16_EXP_MIN = F16_TARGET_EXP - 127
F16_TABLE_REGIONS = 7   # exponent, amax, changes, least e, greatest e, amax at the last rescale, committed e


def f16_exponent(amax: float, old: int = 0) -> int:
    """The rule on the host (tests, reports): the exponent f16_rescale gives an amax."""
    a = abs(float(np.float32(amax)))
    if a == 0 or not np.isfinite(a):
        return int(old)
    bits = int(np.array(a, np.float32).view(np.uint32))
    return int(min(F16_TARGET_EXP - ((bits >> 23) - 127), F16_EXP_MAX))


class F16Scale:
    """One tensor's slot in a scale table; `calibrate`: its casts first take the amax of the
    tensor itself (a first step, which has no step before it to take it from)."""

    def __init__(self, table: "F16Scales", slot: int):
        self.table, self.slot = table, int(slot)

    @property
    def calibrate(self) -> bool:
        return self.table.calibrate


class F16Scales:
    """Per-tensor scales of --precision mixed's f16 operands, all on the GPU: one i32 table of
    7 regions of n slots (shaders/matmul_f16.wgsl says the layout).  A cast (`cast_f16` with
    a slot) multiplies by its slot's 2^e and adds the tensor's amax into the slot; a product
    of two scaled operands multiplies its result by 2^-(ea + eb) (store_fast); `record_rescale`
    (the trainer's, at the end of each step) sets every slot's next e from the amax of that
    step (`f16_exponent`), so a step's scales come from the step before it and nothing is read
    back.  Slot 0 is the unit scale (e = 0, never rescaled): the weights' (their values are
    far inside f16's range) and any operand without a slot of its own.  While `calibrate` is
    set (a model's first step, or a model used without a trainer: evaluation, tests) each
    cast first takes its own tensor's amax and rescales its slot: at the cost of one more pass
    over the tensor, the first step is scaled too.  The table also keeps a history per slot:
    how often e changed and the least and greatest e (`summary`, `state`)."""

    def __init__(self, rt, names):
        self.rt = rt
        self.names = ["unit"] + [str(n) for n in names]
        self.n = len(self.names)
        self.index = {nm: k for k, nm in enumerate(self.names)}
        self.table: Tensor = rt.zeros((F16_TABLE_REGIONS * self.n,), "i32", name="f16_scales")
        self.calibrate = True

    def __getitem__(self, name: str) -> F16Scale:
        return F16Scale(self, self.index[name])

    def region(self, r: int) -> Tensor:
        return self.table.view((self.n,), r * self.n)

    def record_rescale(self, rec: Recorder, lo: int = 1, hi: int | None = None, commit: bool = True) -> None:
        """Slots [lo, hi) take their next exponent from their amax.  `commit` (a step's end):
        it counts in their history; else (a calibrating cast) it is used until the step's end."""
        hi = self.n if hi is None else int(hi)
        if hi <= lo:
            return
        u = self.rt.uniform(pack("4I", lo, hi, self.n, int(commit)))
        rec.dispatch("matmul_f16", "f16_rescale", {0: self.table, 1: u}, cdiv(hi - lo, 64))

    def clear_amax(self, rec: Recorder) -> None:
        """Forget what casts recorded since the last rescale (evaluation between steps): a
        step's scales then depend on the training steps only (a resumed run's too)."""
        rec.clear(self.region(1))

    def state(self) -> np.ndarray:
        """[7, n] i32: what a checkpoint keeps (a GPU sync point)."""
        return self.rt.read(self.table).reshape(F16_TABLE_REGIONS, self.n)

    def load(self, state) -> None:
        a = np.asarray(state)
        if a.shape != (F16_TABLE_REGIONS, self.n):
            from memengine.engine.errors import MemengineError
            raise MemengineError(f"the saved f16 scales have shape {list(a.shape)}; this model's table has "
                                 f"{[F16_TABLE_REGIONS, self.n]} (the state belongs to another model)")
        a = a.astype(np.int32).copy()
        a[1] = 0
        self.rt.write(self.table, a.reshape(-1))
        self.calibrate = False

    def summary(self, state: np.ndarray | None = None) -> dict:
        """{'min', 'max': the least and greatest scale now among the tensors that have one,
        'changes': rescales that changed a scale, over all tensors and steps, 'tensors': how
        many have a scale} (a GPU sync point unless `state` is given)."""
        st = self.state() if state is None else np.asarray(state)
        used = (st[5, 1:] != 0) | (st[0, 1:] != 0)
        e = st[0, 1:][used]
        return {"min": float(2.0 ** int(e.min())) if e.size else 1.0,
                "max": float(2.0 ** int(e.max())) if e.size else 1.0,
                "changes": int(st[2, 1:].sum()), "tensors": int(used.sum())}


def unit_scales(rt) -> Tensor:
    """A scale table of the unit scale only (products and casts of operands without one)."""
    t = rt.scratch("f16.unit_scales", (F16_TABLE_REGIONS,), "i32")
    if not getattr(t, "filled", False):
        rt.write(t, np.zeros(F16_TABLE_REGIONS, np.int32))
        t.filled = True
    return t


def with_scale(t: Tensor | None, scale: F16Scale | None) -> Tensor | None:
    """`t` marked as cast with `scale` (the products read it: `scale_of`)."""
    if t is not None and scale is not None:
        t.f16_scale = scale
    return t


def scale_of(t: Tensor | None) -> F16Scale | None:
    return getattr(t, "f16_scale", None)


def operand_scales(A16: Tensor, B16: Tensor):
    """(table, A's slot, B's slot) of a product's f16 operands; None where neither has a slot
    (the unit table's slot 0 then).  An operand without a slot takes its partner table's slot 0."""
    sa, sb = scale_of(A16), scale_of(B16)
    if sa is None and sb is None:
        return None
    tables = {id(x.table): x.table for x in (sa, sb) if x is not None}
    if len(tables) > 1:
        raise ValueError("matmul: the f16 operands' scales are in two tables")
    table = next(iter(tables.values()))
    return table.table, (sa.slot if sa is not None else 0), (sb.slot if sb is not None else 0)


def cast_f16(rec: Recorder, dst: Tensor, src: Tensor, n: int | None = None,
             scale: F16Scale | None = None) -> Tensor:
    """dst[:n] = f16(src[:n] * s) (WRITE; n defaults to src's size); returns dst, marked with
    `scale` for the products that read it.  dst starts on a multiple of 4 elements and is
    written in whole vec4s: up to n rounded up to 4 (zeros past n; the f16 copies are
    allocated so).  Ranges larger than one storage binding are cast in pieces.
    `scale` (a slot of an F16Scales table): s = its 2^e, and the amax of src[:n] is added
    into the slot for its next rescale (first taken and rescaled to while the table
    calibrates); None: s = 1, nothing recorded."""
    n = src.numel if n is None else int(n)
    if n <= 0:
        return with_scale(dst, scale)
    rt = rec.rt
    if scale is None:
        table, slot, amax_at, mode = unit_scales(rt), 0, 0, 0
    else:
        table, slot = scale.table.table, scale.slot
        amax_at, mode = scale.table.n + slot, 1
        if scale.calibrate:   # this tensor's own amax first, its slot rescaled to it
            _cast_pieces(rec, dst, src, n, table, slot, amax_at, 3)
            scale.table.record_rescale(rec, slot, slot + 1, commit=False)
    _cast_pieces(rec, dst, src, n, table, slot, amax_at, mode)
    return with_scale(dst, scale)


_CAST_V = 8   # the most vec4 an invocation of cast_f16 casts (shaders/matmul_f16.wgsl: CAST_V)


def _cast_per(n4: int) -> int:
    """vec4 an invocation of a cast of n4 vec4: up to _CAST_V while the cast keeps at least
    1024 workgroups of 256 (8 an SM of a 132-SM GPU), else fewer: a small cast (a B 1 step's)
    needs its workgroups to fill the GPU more than it needs its amax's tree shared."""
    return max(1, min(_CAST_V, n4 // (256 * 1024)))


def _cast_pieces(rec, dst, src, n, table, slot, amax_at, mode) -> None:
    rt = rec.rt
    piece = max(4, (rt.max_binding - rt.storage_align) // 4 // 1024 * 1024)   # f32 elements
    for s0 in range(0, n, piece):
        m = min(piece, n - s0)
        n4 = cdiv(m, 4)
        s, es = bound(rt, Tensor(src.buffer, (m,), src.dtype, src.offset + 4 * s0))
        d, ed = bound(rt, Tensor(dst.buffer, (4 * n4,), dst.dtype, dst.offset + 2 * s0))
        if ed % 4:
            raise ValueError("cast_f16: the f16 view must start on a multiple of 4 elements")
        if d.offset + d.nbytes > d.buffer.size:
            raise ValueError("cast_f16: the rounded-up f16 range runs past its buffer")
        per = _cast_per(n4)
        u = rt.uniform(pack("8I", m, n4, es, ed // 4, slot, amax_at, mode, per))
        rec.dispatch("matmul_f16", "cast_f16", {0: s, 1: d, 2: u, 3: table}, cdiv(n4, 256 * per))


def linear_forward(rec: Recorder, out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, *,
                   M: int, N: int, K: int, ldx: int | None = None, x_col: int = 0,
                   ldo: int | None = None, out_col: int = 0, acc: bool = False,
                   x16: Tensor | None = None, w16: Tensor | None = None) -> None:
    """out[M, N] (+)= x[M, K] @ weight[N, K]^T + bias.  With x16 and w16 (f16 copies of x
    and weight, --precision mixed) the product takes them where the shape allows."""
    matmul(rec, out, x, weight, M=M, N=N, K=K, trans_b=True, lda=ldx, ldb=K, ldc=ldo,
           a_col=x_col, c_col=out_col, acc=acc, bias=bias, A16=x16, B16=w16)


def linear_backward(rec: Recorder, dx: Tensor | None, dweight: Tensor | None, dbias: Tensor | None,
                    dout: Tensor, x: Tensor, weight: Tensor, ones: Tensor | None = None, *,
                    M: int, N: int, K: int, ldx: int | None = None, x_col: int = 0,
                    lddo: int | None = None, dout_col: int = 0, lddx: int | None = None,
                    dx_col: int = 0, dx_acc: bool = False,
                    x16: Tensor | None = None, w16: Tensor | None = None,
                    dout16: Tensor | None = None, dout_scale: F16Scale | None = None) -> None:
    """dx (+)= dout @ weight; dweight += dout^T @ x; dbias += column sums of dout.

    dout is [M, N] (row stride lddo), x is [M, K] (row stride ldx), weight [N, K].
    `ones` is a tensor of at least M ones, needed only for dbias.
    --precision mixed: `dout16` is f16 scratch of at least M*lddo elements; dout is cast
    into it (times `dout_scale`'s 2^e where given: a slot of its own, F16Scales) and the two
    products take it with `w16` (f16 weight) and `x16` (the forward's f16 copy of x) where
    the shape allows.  dbias stays f32.
    """
    ldo = lddo if lddo is not None else N
    if dout16 is not None and ((dx is not None and w16 is not None) or (dweight is not None and x16 is not None)):
        dout16 = dout16.view((M * ldo,))   # exactly dout's extent (the scratch may be larger)
        cast_f16(rec, dout16, dout, M * ldo, scale=dout_scale)
    else:
        dout16 = None
    if dx is not None:
        matmul(rec, dx, dout, weight, M=M, N=K, K=N, lda=ldo,
               a_col=dout_col, ldb=K, ldc=lddx, c_col=dx_col, acc=dx_acc, A16=dout16, B16=w16)
    if dweight is not None:
        matmul(rec, dweight, dout, x, M=N, N=K, K=M, trans_a=True,
               lda=ldo, a_col=dout_col,
               ldb=ldx if ldx is not None else K, b_col=x_col, acc=True, A16=dout16, B16=x16)
    if dbias is not None:
        assert ones is not None, "dbias needs a ones vector"
        matmul(rec, dbias, ones, dout, M=1, N=N, K=M, lda=M,
               ldb=lddo if lddo is not None else N, b_col=dout_col, acc=True)
