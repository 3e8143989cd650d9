# Timing-only diagnostics of matmul_fast on the device (results wrong): each patch removes
# part of the inner loop; the matmul bench times a step's products in a fresh process.
import os, subprocess, sys
P = "shaders/matmul.wgsl"
orig = open(P).read()
patches = {
 "base": [],
 "masked-lds": [("let a0 = As4[k * AQ + ty];", "let a0 = As4[(k * AQ + ty) & (NA - 1u)];"),
                ("let a1 = As4[k * AQ + TY + ty];", "let a1 = As4[(k * AQ + TY + ty) & (NA - 1u)];"),
                ("let b0 = Bs4[k * BQ + tx];", "let b0 = Bs4[(k * BQ + tx) & (NB - 1u)];"),
                ("let b1 = Bs4[k * BQ + TX + tx];", "let b1 = Bs4[(k * BQ + TX + tx) & (NB - 1u)];")],
 "base-again": [],
}
for name, subs in patches.items():
    s = orig
    for a, b in subs:
        assert a in s, (name, a[:60])
        s = s.replace(a, b)
    open(P, "w").write(s)
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"mmdiag_{name}.json")
    r = subprocess.run([sys.executable, "benchmarks/bench.py", "--suite", "matmul", "--no-torch", "--out", out], capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if "step total" in l or l.startswith("  in_proj fwd ")]
    print(f"{name:22s} " + " | ".join(line) if line else r.stderr[-400:], flush=True)
open(P, "w").write(orig)
