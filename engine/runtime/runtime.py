"""The runtime: one device of a backend (engine/backend) and its caches: shader modules
(the WGSL linker), pipelines, bind groups, uniform blocks, pooled buffers and scratch, the
binding and buffer limits, and the runtime of each device request (`get_runtime`)."""

from __future__ import annotations

import contextlib
import os
from importlib import resources

import numpy as np
from memengine.engine.backend import (AUTO, ENV_BACKEND, SHADER_F16, SUBGROUP_MATRIX, SUBGROUPS, TIMESTAMPS,
                                      adapter_kind, backend_request, open_adapter)
from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import fmt_bytes
from memengine.engine.runtime.pacing import MAX_PIECES, Pacer
from memengine.engine.runtime.profiler import Profiler
from memengine.engine.runtime.recorder import Recorder, StepFence
from memengine.engine.runtime.settings import KernelSettings
from memengine.engine.runtime.tensor import DTYPES, ITEMSIZE, Tensor, Uniform

# environment variables that lower the adapter's limits (bytes; K/M/G suffixes = KiB/MiB/GiB)
ENV_MAX_BINDING = "MEMENGINE_MAX_BINDING_BYTES"
ENV_MAX_BUFFER = "MEMENGINE_MAX_BUFFER_BYTES"
MIN_FORCED_LIMIT = 4096
# storage buffers one entry point may bind, asked of the device up to what the adapter has:
# the kernels bind at most 8 (WebGPU's default), the 8-lane scan backward of CPU adapters 9
# (ops/lanes.py takes the 8-lane kernels only where the device grants that many)
STORAGE_BUFFERS = 9


def parse_bytes(text: str, what: str) -> int:
    """'4096', '64K', '128M', '2G' (binary units) -> bytes; MemengineError naming `what`."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        n = int(float(t) * mult)
    except (ValueError, OverflowError):
        raise MemengineError(f"{what}={text!r}: expected a number of bytes (e.g. 65536, 64K, 128M)") from None
    if n < 1:
        raise MemengineError(f"{what}={text!r}: must be a positive number of bytes")
    return n


def env_flag(name: str) -> bool:
    """An on/off variable: unset, empty, 0/false/no/off, or 1/true/yes/on; else one error line."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise MemengineError(f"{name}={os.environ.get(name)!r}: expected 1 (on) or 0 (off)")


def env_bytes(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    return parse_bytes(v, name) if v else None


# MEMENGINE_SHADER_CHECKS=1 keeps the WGSL compiler's run-time checks (index clamping,
# loop bounding) in every module: a debugging aid for an out-of-range index.
ENV_SHADER_CHECKS = "MEMENGINE_SHADER_CHECKS"


def _wgsl_path(name: str):
    return resources.files("memengine.shaders").joinpath(f"{name}.wgsl")


class Runtime:
    """One WebGPU device plus caches. Create with `get_runtime()`.

    `backend` is the engine/backend implementation the device comes from (its buffer usage
    flags: `backend.STORAGE` ...; the `backend` argument is --backend: auto, wgpu, dawn, None
    for MEMENGINE_BACKEND or auto); `device` is the device it made, whose objects follow
    wgpu-py's API."""

    def __init__(self, device: str = "auto", verbose: bool = False, backend: str | None = None):
        self.backend, self.adapter = open_adapter(backend, device, verbose)
        # --backend auto passed over Dawn's f16 subgroup matrices (a run without --precision
        # mixed): get_runtime sets it on the runtime it resolved auto to
        self.dawn_tensor_cores = False
        b = self.backend
        self.verbose = verbose
        info = b.adapter_info(self.adapter)
        self.adapter_name = str(info.get("device", "unknown"))
        self.backend_type = str(info.get("backend_type", "unknown"))
        self.adapter_type = str(info.get("adapter_type", "unknown"))
        self.device_memory = b.device_memory(self.adapter)   # bytes, where the backend says (Dawn)
        alim = b.adapter_limits(self.adapter)
        adapter_features = b.adapter_features(self.adapter)
        want = {}
        for key in ("max-buffer-size", "max-storage-buffer-binding-size",
                    "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup",
                    "max-compute-workgroup-size-x", "max-compute-workgroup-size-y"):
            if key in alim:
                want[key] = alim[key]
        want["max-storage-buffers-per-shader-stage"] = min(alim.get("max-storage-buffers-per-shader-stage", 8),
                                                           STORAGE_BUFFERS)
        feats = []
        self.has_timestamps = b.FEATURES[TIMESTAMPS] in adapter_features
        if self.has_timestamps:
            feats.append(b.FEATURES[TIMESTAMPS])
        # subgroup operations (shuffles within a SIMD group): kernels that use them go
        # through the helpers of shaders/subgroups.wgsl and keep a workgroup-memory path
        self.has_subgroups = b.FEATURES[SUBGROUPS] in adapter_features
        if self.has_subgroups:
            feats.append(b.FEATURES[SUBGROUPS])
        # f16 arithmetic and storage in shaders (--precision mixed: the f16 matmul path)
        self.has_f16 = b.FEATURES[SHADER_F16] in adapter_features
        self.shader_checks = env_flag(ENV_SHADER_CHECKS)
        if self.has_f16:
            feats.append(b.FEATURES[SHADER_F16])
        # f16 subgroup matrices (tensor cores from WGSL): --precision mixed's products on
        # shaders/matmul_sgmat.wgsl (Dawn only; it needs f16 and subgroups too)
        self.has_subgroup_matrix = (self.has_f16 and self.has_subgroups and SUBGROUP_MATRIX in b.FEATURES
                                    and b.has_f16_subgroup_matrices(self.adapter))
        if self.has_subgroup_matrix:
            feats.append(b.FEATURES[SUBGROUP_MATRIX])
        self.features = set(adapter_features)  # the adapter's, in the backend's spelling
        self.device = b.request_device(self.adapter, feats, want, verbose, checks=self.shader_checks)
        self.limits = b.device_limits(self.device)
        self.storage_align = int(self.limits.get("min-storage-buffer-offset-alignment", 256))
        self.largest_buffer = 0  # the largest storage buffer made (see fits_all)
        self.unsplit = True
        self.adapter_max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.adapter_max_buffer = int(self.limits["max-buffer-size"])
        self.max_binding = self.adapter_max_binding
        self.max_buffer = self.adapter_max_buffer
        self.apply_env_limits()
        self.uniform_align = int(self.limits.get("min-uniform-buffer-offset-alignment", 256))
        self._modules: dict = {}
        self._pipelines: dict = {}
        self._bind_groups: dict = {}
        self._uniforms: dict = {}
        self._pool: dict[tuple, list] = {}
        self._scratch: dict = {}
        self.bytes_allocated = 0
        self.peak_bytes = 0
        # how Recorder.boundary submits steps in pieces: a trainer hands its own in
        self.pacer = Pacer()
        # the kernels' switches (MEMENGINE_MATMUL ...), read once
        self.kernels = KernelSettings.from_env()
        # Recorder.copy / clear as dispatches (shaders/copy.wgsl) rather than buffer copies
        # and clears, which end the compute pass: on the H200 a step's 194 copies cost 1.4%
        # of it that way; on a CPU adapter a dispatch costs more than a pass break
        self.copy_by_dispatch = "cpu" not in adapter_kind(info)
        self._piece_fence = None

    # ------------------------------------------------------------------ limits
    def set_limits(self, binding: int | None = None, buffer: int | None = None) -> None:
        """Use at most `binding` bytes per storage binding and `buffer` bytes per buffer
        (None: the adapter's own).  Limits can only be lowered, never raised."""
        buf = self.adapter_max_buffer if buffer is None else min(int(buffer), self.adapter_max_buffer)
        bind = self.adapter_max_binding if binding is None else min(int(binding), self.adapter_max_binding)
        for name, v in (("buffer", buf), ("binding", bind)):
            if v < MIN_FORCED_LIMIT:
                raise MemengineError(f"the forced {name} limit must be at least {MIN_FORCED_LIMIT} bytes (got {v})")
        self.max_buffer = buf & ~3
        self.max_binding = min(bind, buf) & ~3
        self._update_unsplit()

    def _update_unsplit(self) -> None:
        """`unsplit`: every storage buffer made so far fits one binding (see ranges.fits_all)."""
        self.unsplit = self.largest_buffer <= self.max_binding - (self.storage_align - 4)

    def apply_env_limits(self) -> None:
        """Apply MEMENGINE_MAX_BINDING_BYTES / MEMENGINE_MAX_BUFFER_BYTES (unset: the adapter's)."""
        self.set_limits(env_bytes(ENV_MAX_BINDING), env_bytes(ENV_MAX_BUFFER))

    @contextlib.contextmanager
    def forced_limits(self, binding: int | None = None, buffer: int | None = None):
        """Temporarily lower the limits (tests: make every tensor split)."""
        saved = (self.max_binding, self.max_buffer)
        self.set_limits(binding, buffer)
        try:
            yield self
        finally:
            self.max_binding, self.max_buffer = saved
            self._update_unsplit()

    # ------------------------------------------------------------------ description
    def describe(self) -> str:
        """The adapter as a run's header shows it: name (API, type) via the backend."""
        return f"{self.adapter_name} ({self.backend_type}, {self.adapter_type}) via {self.backend.label}"

    @property
    def backend_name(self) -> str:
        """The backend's --backend name (wgpu, dawn): memengine.json's `backend`."""
        return self.backend.name

    # optional adapter features that kernels may use where present (the plain path is the
    # reference); reported by `memengine info` in the backend's spelling
    OPTIONAL_FEATURES = (TIMESTAMPS, SUBGROUPS, SHADER_F16, SUBGROUP_MATRIX)

    def has_feature(self, name: str) -> bool:
        """Whether the adapter has an optional feature (TIMESTAMPS, SUBGROUPS, SHADER_F16 of
        engine/backend: the runtime's names, whatever the backend calls them)."""
        return self.backend.FEATURES.get(name, name) in self.features

    def limit(self, name: str, default: int = 0) -> int:
        """One of the device's limits by WebGPU's kebab-case name ('max-buffer-size')."""
        return int(self.limits.get(name, default))

    def capabilities(self) -> dict:
        feats = (self.backend.FEATURES[f] for f in self.OPTIONAL_FEATURES if f in self.backend.FEATURES)
        return {
            "features": [f for f in feats if f in self.features],
            "max_storage_binding_bytes": self.max_binding,
            "max_buffer_bytes": self.max_buffer,
        }

    # ------------------------------------------------------------------ shaders
    # Every module gets shaders/common.wgsl (sigmoid, silu, softplus) put in front of it.
    # A shader whose first line is `// requires: a, b` gets shaders/a.wgsl and b.wgsl put
    # in front of it too; `subgroups` is shaders/subgroups.wgsl where the device has
    # subgroups, else the stand-ins of shaders/subgroups_off.wgsl (sg_size() == 1, so
    # kernels take their workgroup path).  The module starts with the shader's `enable`
    # directives and those the backend's WGSL compiler wants (Backend.enables: Tint
    # requires `enable subgroups;`, naga refuses it).
    REQUIRES = "// requires:"

    def module_source(self, name: str, subgroups: bool | None = None) -> str:
        """The WGSL of shaders/<name>.wgsl as compiled on this device: its enable directives,
        the preludes it requires, then its own lines (`subgroups`: with the subgroup prelude,
        not its stand-ins; None: where the device has subgroups)."""
        path = _wgsl_path(name)
        try:
            code = path.read_text()
        except FileNotFoundError as e:
            raise RuntimeError(f"shader file not found: shaders/{name}.wgsl") from e
        prelude = [_wgsl_path("common").read_text()]
        lines = code.split("\n")
        uses = False
        if lines[0].startswith(self.REQUIRES):
            for req in lines[0][len(self.REQUIRES):].split(","):
                req = req.strip()
                if req == "subgroups":
                    uses = self.has_subgroups if subgroups is None else subgroups
                    req = "subgroups" if uses else "subgroups_off"
                prelude.append(_wgsl_path(req).read_text())
        # `enable ...;` and `diagnostic(...);` directives (among the leading comments) go in
        # front of everything
        head = 0
        while head < len(lines) and lines[head].startswith(("enable ", "diagnostic(", "//")):
            head += 1
        directive = [i for i in range(head) if lines[i].startswith(("enable ", "diagnostic("))]
        enables = self.backend.enables([lines[i] for i in directive if lines[i].startswith("enable ")], uses)
        diagnostics = [lines[i] for i in directive if lines[i].startswith("diagnostic(")]
        skip = set(directive)
        rest = [ln for i, ln in enumerate(lines) if i not in skip and not ln.startswith("enable ")]
        return "\n".join(enables + diagnostics + prelude + rest)

    def module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            code = self.module_source(name)
            try:
                mod = self.backend.create_module(self.device, name, code, self.shader_checks)
            except Exception as e:
                raise RuntimeError(f"WGSL compile error in shaders/{name}.wgsl: {e}") from e
            self._modules[name] = mod
        return mod

    def pipeline(self, shader: str, entry: str, constants: dict | None = None):
        key = (shader, entry, tuple(sorted((constants or {}).items())))
        p = self._pipelines.get(key)
        if p is None:
            stage = {"module": self.module(shader), "entry_point": entry}
            if constants:
                stage["constants"] = {k: float(v) for k, v in constants.items()}
            try:
                p = self.device.create_compute_pipeline(label=f"{shader}.{entry}", layout="auto", compute=stage)
            except Exception as e:
                raise RuntimeError(f"pipeline error in shaders/{shader}.wgsl entry {entry}: {e}") from e
            self._pipelines[key] = p
        return p

    # ------------------------------------------------------------------ buffers
    def _usage(self):
        b = self.backend
        return b.STORAGE | b.COPY_SRC | b.COPY_DST

    def check_size(self, nbytes: int, what: str = "tensor", scratch: bool = False) -> None:
        """One buffer must fit the largest buffer (bindings are split by the ops;
        `engine.plan` refuses oversized runs, with advice, before anything is uploaded).
        Kernel scratch is checked against the adapter's own limit: a forced lower limit is
        for model tensors."""
        limit = self.adapter_max_buffer if scratch else self.max_buffer
        if nbytes > limit:
            raise MemengineError(
                f"{what} needs {fmt_bytes(nbytes)} in one GPU buffer but the adapter's largest "
                f"buffer is {fmt_bytes(limit)}")

    def create_buffer(self, nbytes: int, label: str = "", scratch: bool = False):
        """A new storage buffer (counted in bytes_allocated / peak_bytes)."""
        self.check_size(nbytes, label or "tensor", scratch)
        buf = self.device.create_buffer(label=label, size=nbytes, usage=self._usage())
        self.largest_buffer = max(self.largest_buffer, nbytes)
        self._update_unsplit()
        self.bytes_allocated += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)
        return buf

    def empty(self, shape, dtype: str = "f32", name: str = "", scratch: bool = False) -> Tensor:
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        nbytes = max(16, ((ITEMSIZE.get(dtype, 4) * n + 15) // 16) * 16)
        self.check_size(nbytes, name or "tensor", scratch)
        key = (nbytes,)
        free = self._pool.get(key)
        buf = free.pop() if free else self.create_buffer(nbytes, name, scratch)
        return Tensor(buf, shape, dtype, 0, name)

    def zeros(self, shape, dtype: str = "f32", name: str = "") -> Tensor:
        t = self.empty(shape, dtype, name)
        enc = self.device.create_command_encoder()
        enc.clear_buffer(t.buffer, 0, t.buffer.size)
        self.device.queue.submit([enc.finish()])
        return t

    def scratch(self, key, shape, dtype: str = "f32") -> Tensor:
        """A persistent scratch tensor, created once per (key, shape, dtype) and reused."""
        k = (key, tuple(int(x) for x in shape), dtype)
        t = self._scratch.get(k)
        if t is None:
            t = self.empty(shape, dtype, name=str(key), scratch=True)
            self._scratch[k] = t
        return t

    def trim(self) -> None:
        """Drop cached bind groups, scratch and pooled buffers so their memory can go
        (between unrelated workloads; pipelines and uniforms stay)."""
        self._bind_groups.clear()
        self._scratch.clear()
        self._pool.clear()
        self.bytes_allocated = 0

    def forget(self, buf) -> None:
        """A buffer made by create_buffer that its owner drops (its memory goes with the last
        reference): no longer counted in bytes_allocated."""
        self.bytes_allocated = max(0, self.bytes_allocated - buf.size)

    def free(self, t: Tensor) -> None:
        """Return a tensor's buffer to the pool (the tensor must not be used again)."""
        if t is None:
            return
        self._pool.setdefault((t.buffer.size,), []).append(t.buffer)

    def upload(self, array, dtype: str | None = None, name: str = "") -> Tensor:
        a = np.asarray(array)
        if dtype is None:
            dtype = {np.dtype(np.float32): "f32", np.dtype(np.uint32): "u32", np.dtype(np.int32): "i32",
                     np.dtype(np.float16): "f16"}.get(a.dtype, "f32")
        a = np.ascontiguousarray(a, dtype=DTYPES[dtype])
        t = self.empty(a.shape, dtype, name)
        self.write(t, a)
        return t

    def write(self, t: Tensor, array) -> None:
        a = np.ascontiguousarray(array, dtype=DTYPES[t.dtype])
        assert a.size == t.numel, (a.shape, t.shape)
        if a.size:
            data = a.tobytes()
            if len(data) % 4:  # an odd number of f16 (writes are whole 4-byte words)
                data += bytes(2)
            self.device.queue.write_buffer(t.buffer, t.offset, data)

    def read(self, t: Tensor) -> np.ndarray:
        self.sync()  # the queued work first, interruptibly; then the copy back is short
        raw = self.device.queue.read_buffer(t.buffer, t.offset, (t.nbytes + 3) // 4 * 4)
        return np.frombuffer(raw, dtype=DTYPES[t.dtype])[:t.numel].copy().reshape(t.shape)

    def uniform(self, data: bytes) -> Uniform:
        """A uniform buffer holding `data`, cached by content (created once per shape)."""
        if len(data) % 16:
            data = data + b"\0" * (16 - len(data) % 16)
        u = self._uniforms.get(data)
        if u is None:
            b = self.backend
            buf = self.device.create_buffer_with_data(data=data, usage=b.UNIFORM | b.COPY_DST)
            u = Uniform(buf, 0, len(data))
            self._uniforms[data] = u
        return u

    def uniform_buffer(self, size: int) -> object:
        """A writable uniform buffer (for values that change per step)."""
        b = self.backend
        return self.device.create_buffer(size=max(16, size), usage=b.UNIFORM | b.COPY_DST)

    def readback_buffer(self, nbytes: int, label: str = "") -> object:
        """A buffer the host maps to read (MAP_READ | COPY_DST): what a copy leaves there is
        read with `read_mapped`, or waited for with `wait_mapped`."""
        b = self.backend
        return self.device.create_buffer(label=label, size=nbytes, usage=b.MAP_READ | b.COPY_DST)

    def read_mapped(self, buf) -> bytes:
        """The bytes of a readback buffer once the GPU work before it is done."""
        return self.backend.read_mapped(buf)

    def wait_mapped(self, buf) -> None:
        """Wait until the GPU work before a readback buffer's copy is done, in slices with
        an interrupt check between them (a Ctrl-C acts within one, see engine/backend)."""
        self.backend.wait_mapped(buf, self.backend.MAP_MODE_READ)

    def write_buffer(self, buf, offset: int, data: bytes) -> None:
        """Queue a write of `data` into a buffer at `offset` (before the next submission)."""
        self.device.queue.write_buffer(buf, offset, data)

    # ------------------------------------------------------------------ binding
    def bind_group(self, pipeline, bindings: dict):
        key = (id(pipeline),) + tuple(
            (i, id(r.buffer), r.offset, (r.nbytes if isinstance(r, Tensor) else r.size))
            for i, r in sorted(bindings.items())
        )
        bg = self._bind_groups.get(key)
        if bg is None:
            entries = []
            for i, r in sorted(bindings.items()):
                size = r.nbytes if isinstance(r, Tensor) else r.size
                if isinstance(r, Tensor):
                    size = min(max(4, (size + 3) // 4 * 4), r.buffer.size - r.offset)
                entries.append({"binding": i, "resource": {"buffer": r.buffer, "offset": r.offset, "size": size}})
            bg = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
            self._bind_groups[key] = (bg, pipeline, bindings)  # keep referents alive
            return bg
        return bg[0]

    def recorder(self) -> "Recorder":
        return Recorder(self)

    # ------------------------------------------------------------------ profiling
    def enable_profiling(self) -> bool:
        """Time every dispatch with timestamp queries (when the adapter has them).

        Each dispatch then gets its own compute pass, so profiled runs are a little
        slower; `profile_report()` gives the totals per kernel entry point.
        """
        if not self.has_timestamps:
            return False
        self.profiler = Profiler(self)
        return True

    def profile_report(self) -> list:
        """[(kernel, calls, total_ms)] sorted by time, and resets the counters."""
        prof = getattr(self, "profiler", None)
        if prof is None:
            return []
        prof.flush()
        rows = sorted(((k, n, t / 1e6) for k, (n, t) in prof.totals.items()), key=lambda r: -r[2])
        prof.totals.clear()
        return rows

    def piece_fence(self) -> StepFence:
        """The fence of the pieces submitted at boundaries, kept `pacer.piece_depth` deep."""
        depth = self.pacer.piece_depth
        if self._piece_fence is None:
            self._piece_fence = StepFence(self, depth=depth, slots=MAX_PIECES)
        self._piece_fence.depth = depth
        return self._piece_fence

    # the pacer's state, read and set through the runtime too
    bounded = property(lambda self: self.pacer.bounded, lambda self, v: setattr(self.pacer, "bounded", v))
    piece_span = property(lambda self: self.pacer.piece_span, lambda self, v: setattr(self.pacer, "piece_span", v))
    piece_depth = property(lambda self: self.pacer.piece_depth,
                           lambda self, v: setattr(self.pacer, "piece_depth", v))
    pieces = property(lambda self: self.pacer.pieces)
    boundaries = property(lambda self: self.pacer.boundaries)

    def sync(self) -> None:
        """Wait until all submitted work is done (in slices, an interrupt acts at once)."""
        # (on_submitted_work_done_sync is unreliable across drivers; a mapped copy is not)
        if getattr(self, "_sync_buf", None) is None:
            self._sync_src = self.empty((4,), "u32", "sync.src")
            self._sync_buf = self.readback_buffer(16, "sync")
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(self._sync_src.buffer, 0, self._sync_buf, 0, 16)
        self.device.queue.submit([enc.finish()])
        self.wait_mapped(self._sync_buf)


_RUNTIMES: dict = {}
# (device request, a mixed run) -> (the backend --backend auto takes, whether Dawn had f16
# subgroup matrices there)
_AUTO: dict = {}


def get_runtime(device: str | None = None, verbose: bool = False, backend: str | None = None,
                precision: str | None = None) -> Runtime:
    """The process-wide runtime for a device request (MEMENGINE_DEVICE when None) on a
    backend request (--backend auto|wgpu|dawn; None: MEMENGINE_BACKEND, else auto) for a
    run of `precision` (auto takes Dawn's tensor cores for "mixed" only)."""
    request = device or os.environ.get("MEMENGINE_DEVICE", "auto")
    which = backend_request(backend)
    dawn_tc = False
    if which == AUTO:   # the backend auto resolves to for this run, once per process
        rkey = (request, precision == "mixed")
        if rkey not in _AUTO:
            found: dict = {}
            b, _ = open_adapter(AUTO, request, verbose, tensor_cores=precision == "mixed", found=found)
            _AUTO[rkey] = (b.name, bool(found.get("dawn_tensor_cores")))
        which, dawn_tc = _AUTO[rkey]
    key = (request, which)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = Runtime(request, verbose, which)
        _RUNTIMES[key] = rt
    else:
        rt.apply_env_limits()
    if dawn_tc and not rt.has_subgroup_matrix:
        rt.dawn_tensor_cores = True
    return rt
