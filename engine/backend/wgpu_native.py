"""The "wgpu" backend: wgpu-native through wgpu-py (wgpu==0.32.0).

Every use of wgpu-py's private API is here: the trusted shader modules
(`wgpuDeviceCreateShaderModuleTrusted` through `wgpu.backends.wgpu_native._api`) and the
map promise's `_thread_event`, which lets `wait_mapped` wait in slices.
"""

from __future__ import annotations

import logging

import wgpu
from memengine.engine import interrupts
from memengine.engine.backend import SHADER_F16, SUBGROUPS, TIMESTAMPS, WAIT_SLICE_S, Backend, silence_fd2


class WgpuNative(Backend):
    name = "wgpu"
    label = "wgpu-native"
    STORAGE = wgpu.BufferUsage.STORAGE
    UNIFORM = wgpu.BufferUsage.UNIFORM
    COPY_SRC = wgpu.BufferUsage.COPY_SRC
    COPY_DST = wgpu.BufferUsage.COPY_DST
    MAP_READ = wgpu.BufferUsage.MAP_READ
    QUERY_RESOLVE = wgpu.BufferUsage.QUERY_RESOLVE
    MAP_MODE_READ = wgpu.MapMode.READ
    # wgpu-native spells the subgroup feature without the s
    FEATURES = {TIMESTAMPS: "timestamp-query", SUBGROUPS: "subgroup", SHADER_F16: "shader-f16"}
    # naga 0.32 takes subgroup built-ins without `enable subgroups;` and rejects the directive
    SUBGROUPS_ENABLE = None

    def quiet(self, verbose: bool) -> None:
        logging.getLogger("wgpu").setLevel(logging.INFO if verbose else logging.ERROR)
        super().quiet(verbose)

    def adapters(self) -> list:
        return list(wgpu.gpu.enumerate_adapters_sync())

    def request_device(self, adapter, features: list, limits: dict, verbose: bool = False, checks: bool = False):
        with silence_fd2(not verbose):
            return adapter.request_device_sync(required_features=features, required_limits=limits)

    def device_limits(self, device) -> dict:
        return dict(device.limits)

    def create_module(self, device, label: str, code: str, checks: bool):
        """Without `checks`, a module compiled without naga's run-time checks.

        By default naga clamps every array index it cannot prove in range and puts a counter
        in every loop that breaks out after 2^64 passes; the counter keeps the driver from
        unrolling the loops of the hot kernels.  Every kernel here guards its own indices
        (and the oracle tests hold them to it), so they are compiled as trusted modules
        (`wgpuDeviceCreateShaderModuleTrusted`)."""
        if checks:
            return device.create_shader_module(label=label, code=code)
        from wgpu.backends.wgpu_native import _api  # (wgpu==0.32.0: its wgpu-native has the call)
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        src = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
        src[0].chain.next = ffi.NULL
        src[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
        desc = _api.new_struct_p(
            "WGPUShaderModuleDescriptor *",
            nextInChain=ffi.cast("WGPUChainedStruct *", src),
            label=_api.to_c_string_view(label),
        )
        mid = _api.libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, desc, 0)  # no checks
        if mid == ffi.NULL:
            raise RuntimeError("shader module creation failed")
        return _api.GPUShaderModule(label, mid, device)

    def wait_mapped(self, buf, mode) -> None:
        """The wait is cut in short slices with an interrupt check between them: a Ctrl-C
        acts within a slice, not after the queued work (a long native wait would keep
        Python from running its handler).  wgpu-py's promise sets `_thread_event` when the
        map is done."""
        promise = buf.map_async(mode)
        done = getattr(promise, "_thread_event", None)
        if done is not None:
            while not done.wait(WAIT_SLICE_S):
                interrupts.check()
        promise.sync_wait()
        buf.unmap()


BACKEND = WgpuNative
