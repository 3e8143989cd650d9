"""Forms of the tensor-core product (shaders/matmul_sgmat.wgsl) side by side on Dawn.

Generates the kernel's WGSL for each form (tile shape, K tile, row padding of the staged
tiles, single or double-buffered staging, the epilogue), checks each against numpy (f16
operands, float64) and times it with timestamp queries at the mamba-130m step's large
products (B 8, L 2048), beside cuBLAS bf16 when torch has CUDA. On the device machine:

    source benchmarks/device_setup.sh; MEMENGINE_BACKEND=dawn python3 benchmarks/sgmat_tune.py

`--forms a,b` picks forms by name, `--list` prints them, `--sass DIR` keeps each form's
compiled code (the driver's shader cache, one process per form) for sass_stats.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# (name, M, N, K, TA, TB, slices): the step's largest products and their layouts
SHAPES = [
    ("in_proj fwd", 16384, 3072, 768, 0, 1, 1),
    ("in_proj dX", 16384, 768, 3072, 0, 0, 1),
    ("in_proj dW", 3072, 768, 16384, 1, 0, 4),
    ("out_proj fwd", 16384, 768, 1536, 0, 1, 1),
    ("lm_head fwd", 1280, 50280, 768, 0, 1, 1),
    ("square NN", 4096, 4096, 4096, 0, 0, 1),
]


# the matmul_sgmat interface, from the shader itself: its bindings 0-5 (the uniform block, split-K
# slice and f16 unscale come from shaders/matmul_params.wgsl, which every form requires; 6 and 7,
# the operands again, each form declares as it reads them)
SGMAT = (ROOT / "shaders/matmul_sgmat.wgsl").read_text()
PRELUDE = "\n".join(ln for ln in SGMAT.splitlines()
                    if ln.startswith("@group(0)") and int(re.search(r"@binding\((\d+)\)", ln).group(1)) < 6)
# matmul_sgmat.wgsl's guarded epilogue (store_c), taken from the shader itself
STORE_C = re.search(r"// C\[r, c\.\.c\+3\] = acc unscaled.*?\n}\n", SGMAT, re.S).group(0)


SMALL = [("small", 256, 384, 320, 0, 1, 1), ("small TA", 256, 384, 320, 1, 0, 2)]   # edges, split-K


def form(name, **kw):
    f = dict(name=name, WM=4, WN=2, TM=2, TN=4, BK=32, PAD=0, DIRECT=0)
    f.update(kw)
    return f


FORMS = [
    form("prod"),                                    # shaders/matmul_sgmat.wgsl itself (its tile per product)
    form("base"),                                    # the kernel before (128x128, 2x4 results a subgroup)
    form("pad", PAD=8),
    form("pad_direct", PAD=8, DIRECT=1),
    form("padk_direct", PADK=8, PADMN=0, DIRECT=1),
    form("padmn_direct", PADK=0, PADMN=8, DIRECT=1),
    form("bk64_pad_direct", BK=64, PAD=8, DIRECT=1),
    form("w2x4_128x256", WM=2, WN=4, TM=4, TN=4, PAD=8, DIRECT=1),
    form("w4x2_256x128", WM=4, WN=2, TM=4, TN=4, PAD=8, DIRECT=1),
    form("w2x4_fast", WM=2, WN=4, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1),
    form("w4x2_fast", WM=4, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1),
    # a smaller workgroup of the same 64 x 64 subgroup part, so that two share an SM (the
    # registers allow one of 8 subgroups) and one's barriers overlap the other's products: the
    # shader's form since results/h100/sgmat_wg128/ (where it beat the 8-subgroup forms above
    # at every large product; with BK 64, or of 2 subgroups, 64 x 128 / 128 x 64, it lost); its
    # interior loop with 8-byte loads, where the shader's loads 16 bytes since results/h100/u4_loads/
    # (1.13-1.31x there)
    form("w2x2_fast", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1),
    # the interior loop's staging: two staged tiles, one barrier a K tile (DB); each subgroup's
    # share of the tiles loaded from storage as subgroup matrices and stored as such (COOP)
    form("w2x2_db", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1, DB=1),
    form("w2x2_coop", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1, COOP=1),
    form("w2x2_coop_db", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1, COOP=1, DB=1),
    # the interior loop's global loads, which bound it (results/h100/products_pf2/: without them
    # it ran 2x): issued two K tiles ahead from a second register set (PF2); a K tile of 64
    form("w2x2_pf2", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1, PF2=1),
    form("w2x2_bk64", WM=2, WN=2, TM=4, TN=4, BK=64, PAD=8, DIRECT=1, FAST=1),
    form("w2x2_bk64_pf2", WM=2, WN=2, TM=4, TN=4, BK=64, PAD=8, DIRECT=1, FAST=1, PF2=1),
    # w2x2_fast with parts of its interior loop left out (timing only: see DIAG in source)
    *[form(f"diag_{d}", WM=2, WN=2, TM=4, TN=4, PAD=8, DIRECT=1, FAST=1, DIAG=d) for d in ("noload", "nostage", "nobar", "mma")],
]


def source(f: dict) -> str:
    """The WGSL of one form (the bindings, uniform block and epilogue of matmul_sgmat)."""
    WM, WN, TM, TN, BK, PAD = f["WM"], f["WN"], f["TM"], f["TN"], f["BK"], f["PAD"]
    PK, PMN = f.get("PADK", PAD), f.get("PADMN", PAD)
    T = 32 * WM * WN
    BM, BN = WM * TM * 16, WN * TN * 16
    na, nb = BM * BK // 4, BK * BN // 4           # vec4 per tile
    assert na % T == 0 and nb % T == 0, f
    la, lb = na // T, nb // T
    V = "4u"   # halves a load
    # shared strides: [m][k] BK+PAD, [k][m] BM+PAD, [k][n] BN+PAD, [n][k] BK+PAD
    a_size = max(BM * (BK + PK), BK * (BM + PMN))
    b_size = max(BN * (BK + PK), BK * (BN + PMN))
    DB, COOP = f.get("DB", 0), f.get("COOP", 0)
    nbuf = 2 if DB else 1
    wg_bytes = 2 * nbuf * (a_size + b_size) + 4 * WM * WN * 256
    if wg_bytes > 49152:
        raise ValueError(f"{f['name']}: {wg_bytes} bytes of workgroup memory")
    o = []
    w = o.append
    w("// requires: matmul_params")
    w("enable f16;\nenable subgroups;\nenable chromium_experimental_subgroup_matrix;")
    w("diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);")
    w(PRELUDE)
    if COOP:   # the operands again as f16 scalars, for subgroupMatrixLoad from storage
        w("@group(0) @binding(6) var<storage, read> A1: array<f16>;")
        w("@group(0) @binding(7) var<storage, read> B1: array<f16>;")
    w(STORE_C)
    w("override TA: u32 = 0u;\noverride TB: u32 = 0u;")
    w(f"const BM: u32 = {BM}u;\nconst BN: u32 = {BN}u;\nconst BK: u32 = {BK}u;\nconst PADK: u32 = {PK}u;\nconst PADMN: u32 = {PMN}u;")
    w(f"const A_SZ: u32 = {a_size}u;\nconst B_SZ: u32 = {b_size}u;\nconst KM: u32 = {BK // 16}u;")
    w(f"var<workgroup> As: array<f16, {nbuf * a_size}>;")
    w(f"var<workgroup> Bs: array<f16, {nbuf * b_size}>;")
    w(f"var<workgroup> Cs: array<f32, {WM * WN * 256}>;")
    w(f"""
fn ga(k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f16> {{
    if (TA != 0u) {{
        let k = e / (BM / 4u); let mq = e % (BM / 4u);
        if (k0 + k < k_hi && row0 + mq * 4u < F.M) {{ return A4[(F.a_off + (k0 + k) * F.lda + row0 + mq * 4u) / 4u]; }}
    }} else {{
        let m = e / (BK / 4u); let kq = e % (BK / 4u);
        if (row0 + m < F.M && k0 + kq * 4u < k_hi) {{ return A4[(F.a_off + (row0 + m) * F.lda + k0 + kq * 4u) / 4u]; }}
    }}
    return vec4<f16>(0.0h);
}}
fn gb(k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f16> {{
    if (TB != 0u) {{
        let n = e / (BK / 4u); let kq = e % (BK / 4u);
        if (col0 + n < F.N && k0 + kq * 4u < k_hi) {{ return B4[(F.b_off + (col0 + n) * F.ldb + k0 + kq * 4u) / 4u]; }}
    }} else {{
        let k = e / (BN / 4u); let nq = e % (BN / 4u);
        if (k0 + k < k_hi && col0 + nq * 4u < F.N) {{ return B4[(F.b_off + (k0 + k) * F.ldb + col0 + nq * 4u) / 4u]; }}
    }}
    return vec4<f16>(0.0h);
}}
fn sa(v: vec4<f16>, e: u32) {{
    var i: u32;
    if (TA != 0u) {{ i = (e / (BM / 4u)) * (BM + PADMN) + (e % (BM / 4u)) * 4u; }}
    else {{ i = (e / (BK / 4u)) * (BK + PADK) + (e % (BK / 4u)) * 4u; }}
    As[i] = v.x; As[i + 1u] = v.y; As[i + 2u] = v.z; As[i + 3u] = v.w;
}}
fn sb(v: vec4<f16>, e: u32) {{
    var i: u32;
    if (TB != 0u) {{ i = (e / (BK / 4u)) * (BK + PADK) + (e % (BK / 4u)) * 4u; }}
    else {{ i = (e / (BN / 4u)) * (BN + PADMN) + (e % (BN / 4u)) * 4u; }}
    Bs[i] = v.x; Bs[i + 1u] = v.y; Bs[i + 2u] = v.z; Bs[i + 3u] = v.w;
}}
fn left(m0: u32, kk: u32, o: u32) -> subgroup_matrix_left<f16, 16, 16> {{
    if (TA != 0u) {{ return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, o + kk * (BM + PADMN) + m0, true, BM + PADMN); }}
    return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, o + m0 * (BK + PADK) + kk, false, BK + PADK);
}}
fn right(n0: u32, kk: u32, o: u32) -> subgroup_matrix_right<f16, 16, 16> {{
    if (TB != 0u) {{ return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, o + n0 * (BK + PADK) + kk, true, BK + PADK); }}
    return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, o + kk * (BN + PADMN) + n0, false, BN + PADMN);
}}
fn patch_out(m: subgroup_matrix_result<f32, 16, 16>, sg: u32, lane: u32, lanes: u32, c_base: u32, r0: u32, q0: u32) {{
    subgroupMatrixStore(&Cs, sg * 256u, m, false, 16u);
    workgroupBarrier();
    for (var e = lane; e < 64u; e += lanes) {{
        let r = e / 4u; let q = (e % 4u) * 4u; let o = sg * 256u + r * 16u + q;
        store_c(c_base, r0 + r, q0 + q, vec4<f32>(Cs[o], Cs[o + 1u], Cs[o + 2u], Cs[o + 3u]));
    }}
    workgroupBarrier();
}}""")
    accs = [(i, j) for i in range(TM) for j in range(TN)]
    w("struct Acc {")
    w(",\n".join(f"    c{i}{j}: subgroup_matrix_result<f32, 16, 16>" for i, j in accs))
    w("}")
    # one 16-step of K: TM lefts, then each right against them
    w("fn kstep(acc: ptr<function, Acc>, sm: u32, sn: u32, kk: u32, ao: u32, bo: u32) {")
    for i in range(TM):
        w(f"    let a{i} = left(sm + {16 * i}u, kk, ao);")
    for j in range(TN):
        w(f"    {'var b' if j == 0 else 'b'} = right(sn + {16 * j}u, kk, bo);")
        for i in range(TM):
            w(f"    (*acc).c{i}{j} = subgroupMatrixMultiplyAccumulate(a{i}, b, (*acc).c{i}{j});")
    w("}")
    if COOP:
        # the j-th 16 x 16 matrix of a tile (row-major over the tile's 16-blocks: BK / 16 = KM
        # of them along K) straight from storage as a subgroup matrix, and into the staged tile;
        # K-contiguous in memory (A, B^T) it is row-major for A's left, column-major for B's right
        for op, kind, arr, buf, kc, off, ld, MN in (("a", "left", "As", "A1", "TA == 0u", "a_off", "lda", "BM"),
                                                   ("b", "right", "Bs", "B1", "TB != 0u", "b_off", "ldb", "BN")):
            fk, fm = ("false", "true") if op == "a" else ("true", "false")
            mt = f"subgroup_matrix_{kind}<f16, 16, 16>"
            w(f"""
fn coop_{op}(k0: u32, rc0: u32, j: u32) -> {mt} {{
    let i = j / KM; let ki = j % KM;
    if ({kc}) {{ return subgroupMatrixLoad<{mt}>(&{buf}, F.{off} + (rc0 + i * 16u) * F.{ld} + k0 + ki * 16u, {fk}, F.{ld}); }}
    return subgroupMatrixLoad<{mt}>(&{buf}, F.{off} + (k0 + ki * 16u) * F.{ld} + rc0 + i * 16u, {fm}, F.{ld});
}}
fn coop_s{op}(m: {mt}, j: u32, o: u32) {{
    let i = j / KM; let ki = j % KM;
    if ({kc}) {{ subgroupMatrixStore(&{arr}, o + i * 16u * (BK + PADK) + ki * 16u, m, {fk}, BK + PADK); return; }}
    subgroupMatrixStore(&{arr}, o + ki * 16u * ({MN} + PADMN) + i * 16u, m, {fm}, {MN} + PADMN);
}}""")
    w(f"""
@compute @workgroup_size({T})
fn matmul_sgmat(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
                @builtin(subgroup_size) lanes: u32) {{
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let sm = (sg / {WN}u) * {TM * 16}u;
    let sn = (sg % {WN}u) * {TN * 16}u;
    let ks = k_slice(wid.z);
    let k_lo = ks.x; let k_hi = ks.y; let c_base = ks.z;
    UNSCALE = f16_unscale(f16_exps[F.sa], f16_exps[F.sb]);
    var acc: Acc;""")
    def tile_lines(indent, fmt):   # one line a vec4 of each operand's tile an invocation holds
        for op, n in (("a", la), ("b", lb)):
            for t in range(n):
                w(indent + fmt.format(op=op, t=t, e=f"tid + {t * T}u", rc="row0" if op == "a" else "col0"))
    if f.get("FAST"):
        # interior tiles (whole in M and N, K a multiple of BK): each invocation's vec4s of a
        # tile at offsets fixed outside the K loop (its first vec4's row tid / R and column
        # tid % R of a tile row of R vec4, the t-th T / R rows further), no bounds checks
        kmul = "(2u * BK)" if f.get("PF2") else "BK"   # PF2: K tiles two at a time
        w(f"    let interior = row0 + BM <= F.M && col0 + BN <= F.N && (k_hi - k_lo) % {kmul} == 0u;")
        w("    if (interior) {")
        walks = () if COOP else (("a", "TA", "a_off", "lda", "row0", "TA", "BM", "PADMN", "As"),
                                 ("b", "TB", "b_off", "ldb", "col0", "TB", "BN", "PADMN", "Bs"))
        for op, T_, off, ld, rc, TX, MN, PADo, arr in walks:   # (COOP loads whole matrices instead)
            # K-contiguous rows ([m][k] for A, [n][k] for B) unless the operand's flag says
            # MN-contiguous ([k][m] for A^T, [k][n] for B)
            kc = f"{TX} == 0u" if op == "a" else f"{TX} != 0u"
            w(f"        var g{op} = 0u; var s{op}0 = 0u; var g{op}t = 0u; var s{op}t = 0u; var g{op}k = 0u;")
            w(f"        if ({kc}) {{")
            w(f"            let r = tid / (BK / {V}); let c = tid % (BK / {V});")
            w(f"            g{op} = F.{off} / {V} + ({rc} + r) * (F.{ld} / {V}) + k_lo / {V} + c;")
            w(f"            g{op}t = ({T}u / (BK / {V})) * (F.{ld} / {V}); g{op}k = BK / {V};")
            w(f"            s{op}0 = r * (BK + PADK) + c * {V}; s{op}t = ({T}u / (BK / {V})) * (BK + PADK);")
            w("        } else {")
            w(f"            let r = tid / ({MN} / {V}); let c = tid % ({MN} / {V});")
            w(f"            g{op} = F.{off} / {V} + (k_lo + r) * (F.{ld} / {V}) + {rc} / {V} + c;")
            w(f"            g{op}t = ({T}u / ({MN} / {V})) * (F.{ld} / {V}); g{op}k = BK * (F.{ld} / {V});")
            w(f"            s{op}0 = r * ({MN} + {PADo}) + c * {V}; s{op}t = ({T}u / ({MN} / {V})) * ({MN} + {PADo});")
            w("        }")
        def fast_lines(indent, fmt):
            for op, n, src in (("a", la, "A4"), ("b", lb, "B4")):
                for t in range(n):
                    w(indent + fmt.format(op=op, t=t, src=src, arr="As" if op == "a" else "Bs"))
        nc = (BM // 16) * (BK // 16) // (WM * WN)   # matrices of each tile a subgroup stages (COOP)
        assert not COOP or nc * WM * WN == (BM // 16) * (BK // 16) == (BN // 16) * (BK // 16), f

        def stage(indent, oa, ob, regs="f"):   # regs: the register set staged (f, or PF2's h)
            x = "" if regs == "f" else regs        # (its index names apart from f's)
            if COOP:
                for t in range(nc):
                    w(indent + f"coop_sa(pa{t}, sg * {nc}u + {t}u, {oa}); coop_sb(pb{t}, sg * {nc}u + {t}u, {ob});")
            else:
                for op, n, arr, oo in (("a", la, "As", oa), ("b", lb, "Bs", ob)):
                    for t in range(n):
                        i = f"i{op}{t}{x}"
                        w(indent + f"let {i} = {oo} + s{op}0 + {t}u * s{op}t; {arr}[{i}] = {regs}{op}{t}.x; "
                          f"{arr}[{i} + 1u] = {regs}{op}{t}.y; {arr}[{i} + 2u] = {regs}{op}{t}.z; "
                          f"{arr}[{i} + 3u] = {regs}{op}{t}.w;")
            return

        def load(indent, k):
            if COOP:
                for t in range(nc):
                    w(indent + f"pa{t} = coop_a({k}, row0, sg * {nc}u + {t}u); pb{t} = coop_b({k}, col0, sg * {nc}u + {t}u);")
            else:
                w(indent + "ga += gak; gb += gbk;")
                fast_lines(indent, "f{op}{t} = {src}[g{op} + {t}u * g{op}t];")

        if COOP:
            for t in range(nc):
                w(f"        var pa{t} = coop_a(k_lo, row0, sg * {nc}u + {t}u); var pb{t} = coop_b(k_lo, col0, sg * {nc}u + {t}u);")
        else:
            fast_lines("        ", "var f{op}{t} = {src}[g{op} + {t}u * g{op}t];")
        if f.get("PF2"):   # two register sets: a tile's loads issued two K tiles before it is staged
            fast_lines("        ", "var h{op}{t} = {src}[g{op} + g{op}k + {t}u * g{op}t];")
            w("        ga += gak; gb += gbk;")
            w("        for (var k0 = k_lo; k0 < k_hi; k0 += 2u * BK) {")
            for regs, ahead in (("f", "2u"), ("h", "3u")):
                stage("            ", "0u", "0u", regs)
                w("            workgroupBarrier();")
                w(f"            if (k0 + {ahead} * BK < k_hi) {{")
                w("                ga += gak; gb += gbk;")
                fast_lines("                ", "%s{op}{t} = {src}[g{op} + {t}u * g{op}t];" % regs)
                w("            }")
                for st in range(BK // 16):
                    w(f"            kstep(&acc, sm, sn, {16 * st}u, 0u, 0u);")
                w("            workgroupBarrier();")
            w("        }")
        elif DB:   # two staged tiles: the next one stored while this one multiplies, one barrier a K tile
            stage("        ", "0u", "0u")
            w("        workgroupBarrier();")
            w("        var cur = 0u;")
            w("        for (var k0 = k_lo; k0 < k_hi; k0 += BK) {")
            w("            let more = k0 + BK < k_hi;")
            w("            if (more) {")
            load("                ", "k0 + BK")
            w("            }")
            for st in range(BK // 16):
                w(f"            kstep(&acc, sm, sn, {16 * st}u, cur * A_SZ, cur * B_SZ);")
            w("            if (more) {")
            stage("                ", "(1u - cur) * A_SZ", "(1u - cur) * B_SZ")
            w("            }")
            w("            workgroupBarrier();")
            w("            cur = 1u - cur;")
            w("        }")
        else:
            # DIAG (timing only, wrong results): which parts of the loop bound it. "noload": no
            # global loads in the loop (the first tile's registers staged again and again);
            # "nostage": nor stores (the first tile staged once); "nobar": nor barriers; "mma":
            # the subgroup's matrices loaded once, only the products in the loop
            diag = f.get("DIAG", "")
            if diag in ("nostage", "nobar", "mma"):
                stage("        ", "0u", "0u")
                w("        workgroupBarrier();")
            if diag == "mma":
                for i in range(TM):
                    w(f"        let la{i} = left(sm + {16 * i}u, 0u, 0u);")
                for j in range(TN):
                    w(f"        let rb{j} = right(sn + {16 * j}u, 0u, 0u);")
            w("        for (var k0 = k_lo; k0 < k_hi; k0 += BK) {")
            if diag in ("", "noload"):
                stage("            ", "0u", "0u")
            if diag in ("", "noload", "nostage"):
                w("            workgroupBarrier();")
            if diag == "":
                w("            if (k0 + BK < k_hi) {")
                load("                ", "k0 + BK")
                w("            }")
            for st in range(BK // 16):
                if diag == "mma":
                    for j in range(TN):
                        for i in range(TM):
                            w(f"            acc.c{i}{j} = subgroupMatrixMultiplyAccumulate(la{i}, rb{j}, acc.c{i}{j});")
                else:
                    w(f"            kstep(&acc, sm, sn, {16 * st}u, 0u, 0u);")
            if diag in ("", "noload", "nostage"):
                w("            workgroupBarrier();")
            w("        }")
        w("    } else {")
    tile_lines("    ", "var v{op}{t} = g{op}(k_lo, k_hi, {rc}, {e});")
    w("    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {")
    tile_lines("        ", "s{op}(v{op}{t}, {e});")
    w("        workgroupBarrier();")
    w("        if (k0 + BK < k_hi) {")
    w("            let k1 = k0 + BK;")
    tile_lines("            ", "v{op}{t} = g{op}(k1, k_hi, {rc}, {e});")
    w("        }")
    for st in range(BK // 16):
        w(f"        kstep(&acc, sm, sn, {16 * st}u, 0u, 0u);")
    w("        workgroupBarrier();")
    w("    }")
    if f.get("FAST"):
        w("    }")
    w("    let r0 = row0 + sm;\n    let q0 = col0 + sn;")
    if f["DIRECT"]:
        w("    let us = f16_unscale(f16_exps[F.sa], f16_exps[F.sb]);   // uniform, as the scalar ops want")
        w("    let whole = row0 + BM <= F.M && col0 + BN <= F.N;")
        w("    if (whole && (F.ksplit != 0u || (F.flags & 3u) == 0u)) {")
        for i, j in accs:
            v = f"subgroupMatrixScalarMultiply(subgroupMatrixScalarMultiply(acc.c{i}{j}, us.x), us.y)"
            w(f"        subgroupMatrixStore(&C1, c_base + (r0 + {16 * i}u) * F.ldc + q0 + {16 * j}u, {v}, false, F.ldc);")
        w("        return;")
        w("    }")
    for i, j in accs:
        w(f"    patch_out(acc.c{i}{j}, sg, lane, lanes, c_base, r0 + {16 * i}u, q0 + {16 * j}u);")
    w("}")
    return "\n".join(o) + "\n"


def tiles(f):
    return f["WM"] * f["TM"] * 16, f["WN"] * f["TN"] * 16


def run(forms, shapes, reps, out_json, torch_ok=True):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench import _gpu_ms  # noqa: E402
    from memengine.engine.kernels import matmul as mm
    from memengine.engine.runtime import cdiv, get_runtime, pack

    rt = get_runtime(backend=os.environ.get("MEMENGINE_BACKEND", "dawn"))
    print(rt.describe(), "subgroup matrices", rt.has_subgroup_matrix, flush=True)
    shader_dir = ROOT / "shaders"
    torch = None
    if torch_ok:
        try:
            import torch as _t
            torch = _t if _t.cuda.is_available() else None
        except Exception:
            torch = None
    rng = np.random.default_rng(1)
    results = []
    table = mm.unit_scales(rt)
    bias = rt.upload(np.zeros(64, np.float32))
    warm = True
    for (sname, M, N, K, ta, tb, slices) in shapes:
        sa = (K, M) if ta else (M, K)
        sb = (N, K) if tb else (K, N)
        a = (rng.random(sa, dtype=np.float32) - 0.5).astype(np.float16)
        b = (rng.random(sb, dtype=np.float32) - 0.5).astype(np.float16)
        A16 = rt.empty(sa, "f16"); B16 = rt.empty(sb, "f16")
        A32 = rt.upload(a.astype(np.float32)); B32 = rt.upload(b.astype(np.float32))
        rec = rt.recorder(); mm.cast_f16(rec, A16, A32); mm.cast_f16(rec, B16, B32); rec.submit()
        rt.free(A32); rt.free(B32)
        ks = K if slices == 1 else cdiv(cdiv(K, slices), 64) * 64
        ns = cdiv(K, ks)
        C = rt.empty((ns * M * N,))
        am = a.T if ta else a
        bm = b.T if tb else b
        pick = np.linspace(0, M - 1, 6).astype(int)
        want = am[pick].astype(np.float64) @ bm.astype(np.float64)
        flops = 2.0 * M * N * K
        row = dict(shape=sname, M=M, N=N, K=K, TA=ta, TB=tb, slices=ns)
        for f in forms:
            name = f["name"]
            BM, BN = tiles(f)
            if name == "prod":   # shaders/matmul_sgmat.wgsl as it is
                sh = "matmul_sgmat"
            else:
                sh = f"_tune_{name}"
                (shader_dir / f"{sh}.wgsl").write_text(source(f))
            u = rt.uniform(pack("16I", M, N, K, (4 if ta else 0) | (8 if tb else 0), 0, M if ta else K, 0,
                                K if tb else N, 0, N, 0, 0 if ns == 1 else ks, 0, 0, 0, 0))
            binds = {0: C, 1: A16, 2: B16, 3: bias, 4: u, 5: table}
            if f.get("COOP") or name == "prod":
                binds.update({6: A16, 7: B16})
            consts = {"TA": ta, "TB": tb}
            if name == "prod":   # its tile as the wrapper has it
                BM, BN = mm.SGMAT_TILE
            groups = (cdiv(N, BN), cdiv(M, BM), ns)

            def fn(rec, binds=binds, groups=groups, sh=sh, consts=consts):
                rec.dispatch(sh, "matmul_sgmat", binds, groups, consts)
            try:
                if warm:   # an idle GPU clocks up first
                    t_end = time.perf_counter() + 2.0
                    while time.perf_counter() < t_end:
                        rec = rt.recorder(); fn(rec); rec.submit(); rt.sync()
                    warm = False
                rt.write(C, np.full(ns * M * N, np.nan, np.float32))
                rec = rt.recorder(); fn(rec); rec.submit()
                got = rt.read(C).reshape(ns, M, N).sum(0)
                err = float(np.abs(got[pick] - want).max() / np.abs(want).max())
                r = _gpu_ms(rt, lambda rec: [fn(rec) for _ in range(4)], reps=reps)
                ms = r["ms"] / 4
                row[name] = dict(ms=ms, tflops=flops / ms / 1e9, err=err)
                print(f"{sname:13s} {name:20s} {flops / ms / 1e9:7.1f} TFLOP/s  {ms:.3f} ms  err {err:.1e}", flush=True)
            except Exception as e:   # a form that does not compile or run: say so, go on
                row[name] = dict(error=str(e)[:2000])
                print(f"{sname:13s} {name:20s} ERROR {str(e)[:600]}", flush=True)
        if torch is not None:
            ta_ = torch.from_numpy(am.astype(np.float32)).cuda().bfloat16()
            tb_ = torch.from_numpy(bm.astype(np.float32)).cuda().bfloat16()
            tc = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.mm(ta_, tb_, out=tc)
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ts = []
            for _ in range(10):
                ev[0].record(); torch.mm(ta_, tb_, out=tc); ev[1].record(); torch.cuda.synchronize()
                ts.append(ev[0].elapsed_time(ev[1]))
            ms = sorted(ts)[len(ts) // 2]
            row["cublas_bf16"] = dict(ms=ms, tflops=flops / ms / 1e9)
            print(f"{sname:13s} {'cublas_bf16':20s} {flops / ms / 1e9:7.1f} TFLOP/s  {ms:.3f} ms", flush=True)
            del ta_, tb_, tc
            torch.cuda.empty_cache()
        for t in (A16, B16, C):
            rt.free(t)
        results.append(row)
        if out_json:
            Path(out_json).write_text(json.dumps(dict(forms=forms, rows=results), indent=1))
    # the summary: TFLOP/s per form and shape
    names = [f["name"] for f in forms] + (["cublas_bf16"] if torch is not None else [])
    print("\nform" + "".join(f"  {r['shape'][:12]:>12s}" for r in results))
    for n in names:
        cells = []
        for r in results:
            v = r.get(n, {})
            cells.append(f"{v['tflops']:12.1f}" if "tflops" in v else f"{'err':>12s}")
        print(f"{n:20s}" + "  ".join(cells))


def sass(forms, out_dir):
    """Each form's compiled kernels: one process per form with the driver's shader disk cache
    in its own folder (in_proj fwd's layouts: TB; dX's: none; dW's: TA), then the cache's
    kernels disassembled (zstd frames; nvdisasm) into instruction counts and SASS files."""
    import collections
    import re
    import struct

    import zstandard
    nvd = os.environ.get("NVDISASM", "/usr/local/cuda/bin/nvdisasm")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for f in forms:
        cache = Path("/tmp/glc_" + f["name"])
        env = dict(os.environ, __GL_SHADER_DISK_CACHE="1", __GL_SHADER_DISK_CACHE_SKIP_CLEANUP="1",
                   __GL_SHADER_DISK_CACHE_PATH=str(cache))
        subprocess.run([sys.executable, __file__, "--forms", f["name"], "--shapes", "in_proj fwd,in_proj dX,in_proj dW",
                        "--reps", "1", "--no-torch"], env=env, capture_output=True, timeout=300)
        n = 0
        for path in sorted(cache.rglob("*.bin")):
            data = path.read_bytes()
            starts = [m.start() for m in re.finditer(re.escape(b"\x28\xb5\x2f\xfd"), data)]
            for i, st in enumerate(starts):
                e = starts[i + 1] if i + 1 < len(starts) else len(data)
                try:
                    raw = zstandard.ZstdDecompressor().decompress(data[st:e], max_output_size=64 << 20)
                except Exception:
                    continue
                if not raw.startswith(b"NVDANVVMNVuc"):
                    continue
                size, off = struct.unpack_from("<II", raw, 0x4C)
                regs, code = raw[off - 8], raw[off + 8:off + 8 + size]
                tmp = f"/tmp/sass_{n}.bin"
                Path(tmp).write_bytes(code)
                text = subprocess.run([nvd, "-b", "SM90", tmp], capture_output=True, text=True).stdout
                ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text)
                if not any(o.startswith("HMMA") for o in ops):
                    continue   # not a product kernel (the casts)
                mix = collections.Counter(o for o in ops)
                keys = ("HMMA", "LDSM", "LDS", "STS", "LDG", "STG", "BAR", "BRA", "IMAD", "SHFL")
                summ = {k: sum(v for o, v in mix.items() if o.split(".")[0] == k) for k in keys}
                line = f"{f['name']} kernel {n}: {regs} registers, {len(ops)} instructions, {summ}; " \
                       f"{dict(collections.Counter(o for o in ops if o.startswith(('LDS', 'STS', 'LDSM', 'HMMA'))))}"
                print(line, flush=True)
                lines.append(line)
                (out / f"{f['name']}.{n}.sass").write_text(text)
                n += 1
    (out / "summary.txt").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", default="", help="comma-separated form names (default: all)")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--emit", default="", help="print one form's WGSL and exit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--sass", default="", help="keep each form's compiled kernels' SASS in this folder")
    a = ap.parse_args()
    forms = [f for f in FORMS if not a.forms or f["name"] in a.forms.split(",")]
    shapes = [s for s in SHAPES + SMALL if (s[0] in a.shapes.split(",")) if a.shapes] or SHAPES
    if a.list:
        for f in FORMS:
            print(f)
        return
    if a.emit:
        print(source(next(f for f in FORMS if f["name"] == a.emit)))
        return
    if a.sass:
        sass(forms, a.sass)
        return
    run(forms, shapes, a.reps, a.out, not a.no_torch)


if __name__ == "__main__":
    main()
