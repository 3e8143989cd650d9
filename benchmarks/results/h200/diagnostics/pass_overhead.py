# What a dispatch, a pass break and a small buffer copy cost on this adapter (passes_ab.txt):
# N dependent one-line dispatches on G workgroups in one submit ("one"), the same with the
# compute pass ended and begun again after each ("pass"), and with a 1 KiB copy between
# the passes ("copy"); microseconds a dispatch from the difference of N = 2000 and 200.
#   python3 benchmarks/results/h200/diagnostics/pass_overhead.py [G]
import sys
import time

from memengine.engine.runtime import get_runtime

rt = get_runtime(None)
dev = rt.device
code = """
@group(0) @binding(0) var<storage, read_write> buf: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) { buf[g.x] = buf[g.x] * 0.5 + 1.0; }
"""
mod = dev.create_shader_module(code=code)
pl = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
G = int(sys.argv[1]) if len(sys.argv) > 1 else 132
U = rt.backend   # its buffer usage flags (STORAGE, COPY_SRC, COPY_DST)
buf = dev.create_buffer(size=4 * 64 * G, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
buf2 = dev.create_buffer(size=4 * 64 * G, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
bg = dev.create_bind_group(layout=pl.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": buf}}])


def timed(N: int, mode: str) -> float:
    enc = dev.create_command_encoder()
    p = enc.begin_compute_pass()
    for _ in range(N):
        p.set_pipeline(pl)
        p.set_bind_group(0, bg)
        p.dispatch_workgroups(G)
        if mode in ("pass", "copy"):
            p.end()
            if mode == "copy":
                enc.copy_buffer_to_buffer(buf, 0, buf2, 0, 1024)
            p = enc.begin_compute_pass()
    p.end()
    t = time.perf_counter()
    dev.queue.submit([enc.finish()])
    rt.sync()
    return time.perf_counter() - t


res = {}
for rep in range(3):
    for mode in ("one", "pass", "copy"):
        timed(50, mode)
        a, b = timed(200, mode), timed(2000, mode)
        res.setdefault(mode, []).append((b - a) / 1800 * 1e6)
for k, v in res.items():
    print(f"G {G} {k:5s} us per dispatch: " + " ".join(f"{x:.2f}" for x in v))
