"""The "dawn" backend: Dawn (Chrome's WebGPU) through wgpudawn (wgpudawn==0.32.0.4, the
wgpu-py API on Dawn; `pip install memengine[dawn]`).

What differs from wgpu-native, all of it here:
- the instance toggles `allow_unsafe_apis` (Dawn's experimental features: subgroup
  matrices) and `vulkan_enable_f16_on_nvidia` (without it Dawn hides `shader-f16` on
  NVIDIA), set once before the instance exists;
- trusted modules are a device toggle (`disable_robustness`: Tint's index clamping off),
  so `request_device` takes `checks` and `create_module` makes a plain module;
- a map callback comes only from `wgpuInstanceWaitAny` / `ProcessEvents` (wgpu-native's
  promise has a thread event that its poller sets; Dawn's is set by nobody while Python
  waits on it, which hung `wait_mapped`): the wait is `WaitAny` on the map's future, in
  WAIT_SLICE_S slices with an interrupt check between them;
- timestamps unrounded (the device toggle `timestamp_quantization` off: Dawn rounds them to
  65.536 us otherwise, which made every kernel of a profile a multiple of that);
- Tint wants `enable subgroups;` in front of a module that uses subgroup operations;
- `subgroup_matrix_configs(adapter)`: the adapter's subgroup-matrix shapes (Dawn's
  `chromium-experimental-subgroup-matrix`), which `--backend auto` asks for;
- `device_memory(adapter)`: the GPU's memory size from Dawn's memory heaps (the memory
  plan's budget on a GPU; wgpu-native gives none).
"""

from __future__ import annotations

import logging

import wgpudawn as wgpu
from memengine.engine import interrupts
from memengine.engine.backend import (SHADER_F16, SUBGROUP_MATRIX, SUBGROUPS, TIMESTAMPS, WAIT_SLICE_S, Backend,
                                     silence_fd2)
from wgpudawn.backends.dawn import extras

SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"
MEMORY_HEAPS_FEATURE = "adapter-properties-memory-heaps"
INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# the device toggle of a module without Tint's run-time checks (see create_module)
TRUSTED_TOGGLE = "disable_robustness"
# Dawn rounds timestamp queries to 65.536 us by default (a browser's timing-attack guard):
# the kernel profile (--profile) wants them as the GPU gives them
PROFILE_TOGGLES_OFF = ("timestamp_quantization",)


class Dawn(Backend):
    name = "dawn"
    label = "Dawn"
    NO_ADAPTER_HINT = (
        "Dawn finds no adapter it can run on (on a machine without a GPU it needs Mesa 25's "
        "lavapipe: Debian 12's Mesa 22.3 is refused, see README, the Dawn backend); --backend wgpu runs here")
    STORAGE = wgpu.BufferUsage.STORAGE
    UNIFORM = wgpu.BufferUsage.UNIFORM
    COPY_SRC = wgpu.BufferUsage.COPY_SRC
    COPY_DST = wgpu.BufferUsage.COPY_DST
    MAP_READ = wgpu.BufferUsage.MAP_READ
    QUERY_RESOLVE = wgpu.BufferUsage.QUERY_RESOLVE
    MAP_MODE_READ = wgpu.MapMode.READ
    FEATURES = {TIMESTAMPS: "timestamp-query", SUBGROUPS: "subgroups", SHADER_F16: "shader-f16",
                SUBGROUP_MATRIX: SUBGROUP_MATRIX_FEATURE}
    SUBGROUPS_ENABLE = "enable subgroups;"

    _instance_ready = False

    def quiet(self, verbose: bool) -> None:
        logging.getLogger("wgpudawn").setLevel(logging.INFO if verbose else logging.ERROR)
        super().quiet(verbose)

    def _instance(self) -> None:
        """Dawn's instance with the toggles memengine needs (once per process: the toggles
        must be set before the instance is made)."""
        if Dawn._instance_ready:
            return
        try:
            extras.set_instance_extras(enable_toggles=list(INSTANCE_TOGGLES))
        except RuntimeError:  # the instance exists already (made by someone else)
            pass
        Dawn._instance_ready = True

    def adapters(self) -> list:
        self._instance()
        return list(wgpu.gpu.enumerate_adapters_sync())

    def subgroup_matrix_configs(self, adapter) -> list:
        """The adapter's subgroup-matrix configurations ({component_type, result_component_type,
        m, n, k}); [] without `chromium-experimental-subgroup-matrix`."""
        if SUBGROUP_MATRIX_FEATURE not in adapter.features:
            return []
        try:
            return list(extras.get_adapter_properties(adapter).get("subgroup_matrix_configs", []))
        except Exception:
            return []

    def device_memory(self, adapter) -> int | None:
        """The largest device-local heap of Dawn's `adapter-properties-memory-heaps` (an
        H100's 80 GB; lavapipe's: host memory), None without the feature."""
        if MEMORY_HEAPS_FEATURE not in adapter.features:
            return None
        try:
            heaps = extras.get_adapter_properties(adapter).get("memory_heaps", [])
        except Exception:
            return None
        sizes = [int(h.get("size", 0)) for h in heaps if "device-local" in h.get("properties", ())]
        return max(sizes) if sizes and max(sizes) > 0 else None

    def has_f16_subgroup_matrices(self, adapter) -> bool:
        """f16 x f16 -> f32 subgroup matrices of 16x16x16 in subgroups of 32 where the adapter
        says its subgroup sizes (what shaders/matmul_sgmat.wgsl is written for)."""
        return any(str(c.get("component_type")) == "f16" and str(c.get("result_component_type")) == "f32"
                   and (c.get("m"), c.get("n"), c.get("k")) == (16, 16, 16)
                   and c.get("min_subgroup_size", 32) == c.get("max_subgroup_size", 32) == 32
                   for c in self.subgroup_matrix_configs(adapter))

    def request_device(self, adapter, features: list, limits: dict, verbose: bool = False, checks: bool = False):
        toggles = [] if checks else [TRUSTED_TOGGLE]
        with silence_fd2(not verbose):
            return extras.request_device_sync(adapter, required_features=features, required_limits=limits,
                                              enable_toggles=toggles, disable_toggles=list(PROFILE_TOGGLES_OFF))

    def device_limits(self, device) -> dict:
        return dict(device.limits)

    def create_module(self, device, label: str, code: str, checks: bool):
        """Tint's run-time checks (robustness) are a device toggle: the device of a run
        without MEMENGINE_SHADER_CHECKS is made with `disable_robustness` (request_device),
        so every module on it is trusted."""
        return device.create_shader_module(label=label, code=code)

    def wait_mapped(self, buf, mode) -> None:
        """Dawn delivers the map's callback only inside `wgpuInstanceWaitAny` (or
        ProcessEvents): wait on the map's future in WAIT_SLICE_S slices, an interrupt check
        between them, then let the promise take the result."""
        from wgpudawn.backends.dawn._api import ffi, get_wgpu_instance, libf, lib

        promise = buf.map_async(mode)
        future = getattr(promise, "_wgpu_future_id", None)
        if future is not None:
            info = ffi.new("WGPUFutureWaitInfo *")
            info.future.id = future
            instance = get_wgpu_instance()
            ok = (lib.WGPUWaitStatus_Success, lib.WGPUWaitStatus_TimedOut)
            while promise._state == "pending":
                status = libf.wgpuInstanceWaitAny(instance, 1, info, int(WAIT_SLICE_S * 1e9))
                if info.completed:
                    break
                if status not in ok:
                    raise RuntimeError(f"waiting for a mapped buffer failed (status {status})")
                interrupts.check()
        promise.sync_wait()
        buf.unmap()


BACKEND = Dawn
