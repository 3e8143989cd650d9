"""Multiply-add rate of a register-only WGSL loop through naga and the adapter's driver
(timing only): 16 vec4 accumulators, `c += x.s * v` (64 multiply-adds per step), the loop
body written out U times.  On the H200 (fma_rate.txt) the rate rose from 27.7 TFLOP/s (f32,
U 1) to 51.9 (U 16) as naga compiles a module by default, with a loop-bounding counter in
every loop; "trusted" modules are compiled without naga's run-time checks, as memengine
compiles its own (engine/backend/wgpu_native.py, importable as `memengine`: benchmarks/device_setup.sh).

    python3 benchmarks/results/h200/diagnostics/fma_rate.py
"""
import itertools
import time

import numpy as np
import wgpu
from memengine.engine.backend import get_backend


def shader(t, n_iter, unroll):
    z, one = ("0.0h", "1.0001h") if t == "f16" else ("0.0", "1.0001")
    acc = "\n".join(f"    var c{i} = vec4<{t}>({z});" for i in range(16))
    xs = ["x.x", "x.y", "x.z", "x.w"]
    step = [f"        c{i} += {xs[(i // 4 + (i // 2) % 2) % 4]} * v{i % 2};" for i in range(16)]
    body = "\n".join(step + [f"        x = x * vec4<{t}>({one});"])
    total = " + ".join(f"c{i}" for i in range(16))
    return f"""{"enable f16;" if t == "f16" else ""}
@group(0) @binding(0) var<storage, read_write> buf: array<vec4<f32>>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
    let v0 = vec4<{t}>(buf[0] + f32(g.x) * 1e-9);
    let v1 = vec4<{t}>(buf[1]);
    var x = vec4<{t}>(buf[2]);
{acc}
    for (var i = 0u; i < {n_iter // unroll}u; i++) {{
{chr(10).join([body] * unroll)}
    }}
    let s = vec4<f32>({total});
    if (s.x == 12345.0) {{ buf[3u + g.x] = s; }}   // keeps every accumulator live
}}
"""


def main():
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    feats = ["shader-f16"] if "shader-f16" in adapter.features else []
    dev = adapter.request_device_sync(required_features=feats)
    cpu = "llvmpipe" in adapter.info["device"]
    n_iter, groups = (64, 8) if cpu else (4096, 132 * 64)
    print(adapter.info["device"], flush=True)
    buf = dev.create_buffer_with_data(data=np.full(4 * (4 + groups * 256), 0.5, np.float32).tobytes(),
                                      usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    for t in ["f32"] + (["f16"] if feats else []):
        for checks, unroll in itertools.product(("checked", "trusted"), (1, 4, 16)):
            code = shader(t, n_iter, unroll)
            mod = get_backend("wgpu").create_module(dev, "fma", code, checks == "checked")
            pipe = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
            bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                       entries=[{"binding": 0, "resource": {"buffer": buf}}])

            def run(reps):
                enc = dev.create_command_encoder()
                for _ in range(reps):
                    p = enc.begin_compute_pass()
                    p.set_pipeline(pipe)
                    p.set_bind_group(0, bg)
                    p.dispatch_workgroups(groups)
                    p.end()
                dev.queue.submit([enc.finish()])
                dev.queue.read_buffer(buf, 0, 16)

            t_end = time.perf_counter() + 1.0   # an idle GPU clocks up first
            while time.perf_counter() < t_end:
                run(2)
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                run(10)
                best = min(best, (time.perf_counter() - t0) / 10)
            flops = 2.0 * 64 * n_iter * groups * 256
            print(f"{t} {checks} loop body x{unroll:2d}: {flops / best / 1e12:7.2f} TFLOP/s ({best * 1e3:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
