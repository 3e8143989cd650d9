# Timing-only diagnostics on the device (results wrong on purpose): each patch takes one
# part out of a kernel; bench.py times the patched copy in a fresh process.
#   python3 patch_timing.py scan|matmul      (from the repository root, $OUT for the JSON)
# The patches of every batch run on 2026-12-01 (scan_diag1-3.txt, matmul_diag1-2.txt).
import os
import subprocess
import sys

SCAN = {
 "no-pbc-store (removes a binding: refused)": [("pbc[(dl / K) * P.pbc_half + ((b * P.L + t) * P.nblk + blk) * P.N + n0 + n] = w1;", "")],
 "no-butterfly": [("let w8a = bfly(ad0 * du0, sa0 * g0, 8u, dl, tid, QS);", "let w8a = ad0 * du0 + sa0 * g0;"),
                  ("let w8b = bfly(ad1 * du1, sa1 * g1, 8u, dl, tid, QS);", "let w8b = ad1 * du1 + sa1 * g1;"),
                  ("let w4 = bfly(w8a, w8b, 4u, dl, tid, QS);", "let w4 = w8a + w8b;"),
                  ("let w2 = bfly2(w4.xy, w4.zw, 2u, dl, tid, QS);", "let w2 = w4.xy + w4.zw;"),
                  ("let w1 = bfly1(w2.x, w2.y, 1u, dl, tid, QS);", "let w1 = w2.x + w2.y;")],
}
SCAN.update({
 "lg-hot": [("""            load_group(b, c, blk, n0, ng, tid);
            workgroupBarrier();
            // A: the segment's end state from a zero start, and its adjoint total""", """            load_group(0u, 0u, 0u, n0, ng, tid);
            workgroupBarrier();
            // A: the segment's end state from a zero start, and its adjoint total""")],
 "inputs-hot": [("if (ok && t < P.L) { return softplus(delta[P.o_delta + (b * P.L + t) * P.Di + d] + bias); }",
                 "if (ok && t < P.L) { return softplus(delta[P.o_delta + (t % 64u) * P.Di + d] + bias); }"),
                ("if (ok && t < P.L) { return u[P.o_u + (b * P.L + t) * P.Di + d]; }",
                 "if (ok && t < P.L) { return u[P.o_u + (t % 64u) * P.Di + d]; }"),
                ("if (ok && t < P.L) { return du[P.o_du + (b * P.L + t) * P.Di + d]; }",
                 "if (ok && t < P.L) { return du[P.o_du + (t % 64u) * P.Di + d]; }")],
})
SCAN["both-hot"] = SCAN["lg-hot"] + SCAN["inputs-hot"]
SCAN.update({
 "no-outputs": [("        out_bwd(b, t0, d, live, bias, Dd, dt0.x, gb0.x, gd0.x, yp0.x, g0.x, u0.x);",
                 "        if (dot(gb0 + gb1 + gd0 + gd1 + yp0 + yp1, vec4<f32>(1.0)) == 12345.678) { out_bwd(b, t0, d, live, bias, Dd, dt0.x, gb0.x, gd0.x, yp0.x, g0.x, u0.x); }")],
 "no-phase-c-exp": [("""                let a = ash[n * DB + dl];
                let e0 = exp(dt0 * a);
                let e1 = exp(dt1 * a);
                let b0 = bc4(n, 0u, j, 0u);""", """                let a = ash[n * DB + dl];
                let e0 = fma(dt0, vec4<f32>(a), vec4<f32>(1.0));
                let e1 = fma(dt1, vec4<f32>(a), vec4<f32>(1.0));
                let b0 = bc4(n, 0u, j, 0u);""")],
 "pbc-coalesced": [("pbc[(dl / K) * P.pbc_half + ((b * P.L + t) * P.nblk + blk) * P.N + n0 + n] = w1;", "pbc[wg * 128u + tid] = w1;")],
 "no-phase-A": [("""(what it passes to the left)
            for (var n = 0u; n < ng; n++) {""", """(what it passes to the left)
            for (var n = 0u; n < 0u; n++) {""")],
 "no-phase-B": [("""            if (j < ng) { hc0 = bwd_carry(j, dl, ash[j * DB + dl], st0, hc0); }
            if (j + 8u < ng) { hc1 = bwd_carry(j + 8u, dl, ash[(j + 8u) * DB + dl], st1, hc1); }""", "")],
 "no-g-loads": [("if (ok && t < P.L) { return du[P.o_du + (b * P.L + t) * P.Di + d]; }", "if (ok && t < P.L) { return f32(t) * 1e-3; }")],
 "no-dA-sum": [("""for (var jj = 0u; jj < SEG; jj++) {
                sa += xs""", """for (var jj = 0u; jj < 0u; jj++) {
                sa += xs""")],
 "phase-C-one-state": [("""            // C: per state, the 8 steps forward (states) and backward (adjoint, gradients)
            for (var n = 0u; n < ng; n++) {""", """            // C: per state, the 8 steps forward (states) and backward (adjoint, gradients)
            for (var n = 0u; n < 1u; n++) {""")],
})
MATMUL = {
 "half-lds": [("let a1 = As4[k * AQ + TY + ty];", "let a1 = a0.wzyx;"), ("let b1 = Bs4[k * BQ + TX + tx];", "let b1 = b0.wzyx;")],
 "no-a1-lds": [("let a1 = As4[k * AQ + TY + ty];", "let a1 = a0.wzyx;")],
 "no-b1-lds": [("let b1 = Bs4[k * BQ + TX + tx];", "let b1 = b0.wzyx;")],
 "no-next-tile-loads": [("        if (k0 + BK < k_hi) {   // the next tile's loads", "        if (k0 + BK < k_hi && F.K == 12345u) {   // the next tile's loads")],
 "masked-lds": [("let a0 = As4[k * AQ + ty];", "let a0 = As4[(k * AQ + ty) & (NA - 1u)];"),
                ("let a1 = As4[k * AQ + TY + ty];", "let a1 = As4[(k * AQ + TY + ty) & (NA - 1u)];"),
                ("let b0 = Bs4[k * BQ + tx];", "let b0 = Bs4[(k * BQ + tx) & (NB - 1u)];"),
                ("let b1 = Bs4[k * BQ + TX + tx];", "let b1 = Bs4[(k * BQ + TX + tx) & (NB - 1u)];")],
}

KINDS = {"scan": ("shaders/selective_scan.wgsl", SCAN, ["--suite", "scan"], "scan default"),
         "matmul": ("shaders/matmul.wgsl", MATMUL, ["--suite", "matmul", "--no-torch"], "  in_proj fwd ")}


def main(kind):
    path, patches, suite, mark = KINDS[kind]
    orig = open(path).read()
    try:
        for name, subs in {"base": [], **patches}.items():
            s = orig
            for a, b in subs:
                assert a in s, (name, a[:60])
                s = s.replace(a, b)
            open(path, "w").write(s)
            out = os.path.join(os.environ.get("OUT", "/tmp"), f"{kind}_{name.split()[0]}.json")
            r = subprocess.run([sys.executable, "benchmarks/bench.py", *suite, "--out", out], capture_output=True, text=True)
            lines = [l for l in r.stdout.splitlines() if l.startswith(mark) or "step total" in l]
            print(f"{name:22s} " + (" | ".join(lines) if lines else r.stderr[-400:]), flush=True)
    finally:
        open(path, "w").write(orig)


if __name__ == "__main__":
    main(sys.argv[1])
