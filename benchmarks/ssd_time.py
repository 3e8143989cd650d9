"""Time Mamba-2's chunked SSD scan alone (engine/kernels/ssd.py: ssd_forward + ssd_backward,
the 8-lane kernels switched off) on this machine's adapter, for A/B runs of shaders/ssd_scan.wgsl:

    python benchmarks/ssd_time.py B,L,H,P,N,G [reps] [--profile]

The inputs are random (as tests/test_mamba2.py's); one untimed call first, then the median of
`reps` calls, each recorded, submitted and waited for. --profile: then one more call with every
dispatch timed (timestamp queries, where the adapter has them), its kernels' ms printed, the
SSD's products by mode.
"""
import sys
import time

import numpy as np

from memengine.engine.kernels import ssd
from memengine.engine.runtime import get_runtime


def main():
    B, L, H, P, N, G = (int(x) for x in sys.argv[1].split(","))
    args = [a for a in sys.argv[2:] if a != "--profile"]
    reps = int(args[0]) if args else 3
    rt = get_runtime()
    rt.kernels.ssd_lanes = False
    Di = H * P
    C = Di + 2 * G * N
    rng = np.random.default_rng(0)
    t = {k: rt.upload(v) for k, v in dict(
        xbc=(0.5 * rng.standard_normal((B, L, C))).astype(np.float32),
        dt=rng.uniform(0.01, 0.3, (B, L, H)).astype(np.float32), A=rng.uniform(-1, 1, H).astype(np.float32),
        D=rng.standard_normal(H).astype(np.float32), dy=rng.standard_normal((B, L, Di)).astype(np.float32)).items()}
    y, st = rt.zeros((B * L * Di,)), rt.zeros(ssd.state_shape(B, L, H, P, N))
    dx, ddt, dA, dD = rt.zeros((B * L * C,)), rt.zeros((B * L * H,)), rt.zeros((H,)), rt.zeros((H,))
    shape = dict(B=B, L=L, H=H, P=P, N=N, G=G)

    def run():
        rec = rt.recorder()
        ssd.ssd_forward(rec, y, st, t["xbc"], t["dt"], t["A"], t["D"], **shape)
        ssd.ssd_backward(rec, dx, ddt, dA, dD, t["dy"], y, st, t["xbc"], t["dt"], t["A"], t["D"], **shape)
        rec.submit()
        rt.sync()

    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    print(f"{rt.describe()}: B,L,H,P,N,G {sys.argv[1]}: SSD forward + backward "
          f"median {1000 * sorted(ts)[len(ts) // 2]:.1f} ms (min {1000 * min(ts):.1f}) of {reps}")
    if "--profile" in sys.argv[2:] and rt.enable_profiling():
        run()
        for kernel, calls, ms in rt.profile_report():
            print(f"  {kernel:40s} {calls:5d} calls {ms:9.3f} ms")


if __name__ == "__main__":
    main()
