# Timing-only diagnostics of the scan backward on the device: each patch removes one part of
# the kernel (results wrong), the scan bench times it in a fresh process.
import json, os, subprocess, sys
P = "shaders/selective_scan.wgsl"
orig = open(P).read()
patches = {
 "base": [],
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
}
patches["both-hot"] = patches["lg-hot"] + patches["inputs-hot"]
res = {}
for name, subs in patches.items():
    s = orig
    for a, b in subs:
        assert a in s, (name, a[:60])
        s = s.replace(a, b)
    open(P, "w").write(s)
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"diag_{name}.json")
    r = subprocess.run([sys.executable, "benchmarks/bench.py", "--suite", "scan", "--out", out], capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("scan default")]
    print(f"{name:22s} {line[0] if line else r.stderr[-400:]}", flush=True)
open(P, "w").write(orig)
