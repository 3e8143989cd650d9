"""WebGPU runtime: adapter choice, shader/pipeline cache, pooled buffers, dispatch recording.

Conventions every kernel wrapper follows:

* A `Tensor` is a view of a pooled `wgpu` buffer: shape, element type ("f32", "u32",
  "i32"), byte offset.  Elements are 4 bytes, row-major.
* Shaders live in `memengine/shaders/<op>.wgsl`, one file per op, entry points
  `<op>_forward` / `<op>_backward` (and helpers).  A module is compiled once and every
  (shader, entry, constants) pipeline is cached.
* A dispatch names its bindings explicitly: ``{binding_index: Tensor | Uniform}``.
  Pipelines use ``layout="auto"``, so the dict must hold exactly the bindings the entry
  point uses.  Bind groups are cached by (pipeline, buffers, offsets, sizes).
* Uniform blocks are small byte strings; `Runtime.uniform(data)` returns a buffer cached by
  content, so a step that repeats its shapes creates no buffers.  Per-step values
  (AdamW's b1^t) go through `Runtime.write` into a buffer made once.
* Grids larger than 65535 workgroups are folded into (x, y): kernels compute their
  linear workgroup id as ``wid.x + wid.y * nwg.x`` and bounds-check.
* A tensor may be larger than one storage binding (`Runtime.max_binding`): wrappers split
  their call into ranges with `split()` so that every window they bind fits, and bind
  views of the ranges.  When everything fits, `split()` returns one range and the call is
  recorded exactly as without it.  `MEMENGINE_MAX_BINDING_BYTES` / `MEMENGINE_MAX_BUFFER_BYTES`
  lower the adapter's limits (tests force tiny ones so every tensor is split).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import tempfile
from dataclasses import dataclass
from importlib import resources

import numpy as np
from memengine.engine import interrupts
from memengine.engine.errors import MemengineError, NoAdapterError
from memengine.engine.hostmem import fmt_bytes  # noqa: F401  (the ops and the plan format sizes with it)

_DTYPES = {"f32": np.float32, "u32": np.uint32, "i32": np.int32, "f16": np.float16}
# bytes per element: 4, except f16 (mixed precision: the matmul operands' copies)
_ITEMSIZE = {"f16": 2}
MAX_GROUPS = 65535
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


def env_bytes(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    return parse_bytes(v, name) if v else None


def _quiet_environment(verbose: bool) -> None:
    """Keep driver chatter off stderr unless the user asked for it."""
    if verbose:
        logging.getLogger("wgpu").setLevel(logging.INFO)
        return
    logging.getLogger("wgpu").setLevel(logging.ERROR)
    # Mesa prints "XDG_RUNTIME_DIR is invalid or not set" when it is unset/invalid.
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not xdg or not os.path.isdir(xdg):
        d = os.path.join(tempfile.gettempdir(), f"memengine-runtime-{os.getuid()}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(d, 0o700)
        os.environ["XDG_RUNTIME_DIR"] = d


@contextlib.contextmanager
def _silence_fd2(enabled: bool):
    """Drop anything native code writes on fd 2 (driver banners) while enabled."""
    if not enabled:
        yield
        return
    import sys

    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# MEMENGINE_SHADER_CHECKS=1 keeps the WGSL compiler's run-time checks (index clamping,
# loop bounding) in every module: a debugging aid for an out-of-range index.
ENV_SHADER_CHECKS = "MEMENGINE_SHADER_CHECKS"


def _create_module(device, label: str, code: str, checks: bool):
    """A shader module; without `checks`, compiled without naga's run-time checks.

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


@dataclass(eq=False)
class Tensor:
    """A typed, shaped view of a GPU buffer (4-byte elements, 2 for f16; row-major)."""

    buffer: object
    shape: tuple
    dtype: str = "f32"
    offset: int = 0  # bytes
    name: str = ""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.itemsize * self.numel

    def view(self, shape: tuple, offset_elems: int = 0) -> "Tensor":
        t = Tensor(self.buffer, tuple(shape), self.dtype, self.offset + self.itemsize * offset_elems)
        assert t.offset + t.nbytes <= self.offset + self.nbytes, "view past the end of its tensor"
        return t


def bound(rt: "Runtime", t: Tensor, n: int | None = None) -> tuple[Tensor, int]:
    """Bind `t` (a view at any 4-byte offset) from the aligned offset below it.

    Returns the Tensor to bind, covering t's first `n` elements (all by default), and the
    element index of t[0] inside that binding, which the kernel adds to its indices.
    """
    isz = t.itemsize
    if t.offset % isz:
        raise ValueError(f"tensor offset must be a multiple of {isz} bytes")
    n = t.numel if n is None else n
    al = rt.storage_align
    start = (t.offset // al) * al
    extra = (t.offset - start) // isz
    return Tensor(t.buffer, (extra + max(n, 1),), t.dtype, start), extra


@dataclass(eq=False)
class Uniform:
    buffer: object
    offset: int = 0
    size: int = 0


def _wgsl_path(name: str):
    return resources.files("memengine.shaders").joinpath(f"{name}.wgsl")


def list_adapters() -> list:
    import wgpu

    return list(wgpu.gpu.enumerate_adapters_sync())


def _adapter_kind(info) -> str:
    return str(info.get("adapter_type", "")).lower()


def choose_adapter(request: str = "auto", verbose: bool = False):
    """Pick an adapter: 'auto' (best), 'gpu' (real GPU only), 'cpu' (software), or a
    case-insensitive substring of the adapter's name."""
    _quiet_environment(verbose)
    try:
        import wgpu  # noqa: F401
    except Exception as e:  # pragma: no cover
        raise NoAdapterError(f"cannot import wgpu ({e}); install memengine's dependencies") from e
    request = (request or "auto").strip()
    with _silence_fd2(not verbose):
        try:
            adapters = list_adapters()
        except Exception as e:
            adapters = []
            if verbose:
                logging.getLogger("memengine").warning("adapter enumeration failed: %s", e)
    hint = (
        "no WebGPU adapter found; on a machine without a GPU install Mesa's software "
        "Vulkan driver (Debian/Ubuntu: apt-get install -y mesa-vulkan-drivers)"
    )
    if not adapters:
        raise NoAdapterError(hint)

    def score(a):
        info = a.info
        kind = _adapter_kind(info)
        backend = str(info.get("backend_type", "")).lower()
        s = {"discretegpu": 40, "integratedgpu": 30, "virtualgpu": 20, "cpu": 10}.get(kind, 0)
        s += {"vulkan": 5, "metal": 5, "d3d12": 4, "opengl": 1}.get(backend, 0)
        return s

    req = request.lower()
    if req == "auto":
        cands = adapters
    elif req == "gpu":
        cands = [a for a in adapters if _adapter_kind(a.info) != "cpu"]
        if not cands:
            names = ", ".join(sorted({a.info.get("device", "?") for a in adapters}))
            raise NoAdapterError(f"--device gpu: no hardware GPU adapter (found: {names}); use --device auto or cpu")
    elif req == "cpu":
        cands = [a for a in adapters if _adapter_kind(a.info) == "cpu"]
        if not cands:
            raise NoAdapterError("--device cpu: no software adapter found; " + hint.split("; ", 1)[1])
    else:
        cands = [a for a in adapters if req in str(a.info.get("device", "")).lower()
                 or req in str(a.info.get("description", "")).lower()
                 or req in str(a.info.get("vendor", "")).lower()]
        if not cands:
            names = ", ".join(sorted({a.info.get("device", "?") for a in adapters}))
            raise NoAdapterError(f"--device {request!r} matches no adapter (found: {names})")
    return max(cands, key=score)


class BindingError(MemengineError):
    """A single unit of work (a row, a sequence) does not fit one storage binding.  `plain`:
    the message without the advice it carries (`split`'s `advice`), for a caller whose
    user has no such flag (a prompt has no --seq-len)."""

    def __init__(self, message: str, plain: str | None = None):
        super().__init__(message)
        self.plain = message if plain is None else plain


def _unit_text(unit: str, detail: str | None, advice: str | None) -> str:
    """'<unit> (<detail>; <advice>)', the parts given."""
    parts = [p for p in (detail, advice) if p]
    return f"{unit} ({'; '.join(parts)})" if parts else unit


def split(rt: "Runtime", total: int, windows, *, step: int = 1, unit: str = "unit",
          scratch=None, detail: str | None = None, advice: str | None = None) -> list[tuple[int, int]]:
    """Cut `total` units of a call into consecutive (start, count) ranges whose bindings fit.

    `windows(n)` gives the byte sizes of the tensor windows a call over n units binds
    (monotone in n); each must fit `rt.max_binding` after `bound()` moves its start down to
    the offset alignment.  `scratch(n)`, if given, sizes the op's own scratch buffers for n
    units, checked against the adapter's limit (a forced lower limit is for model tensors).
    When the whole call fits this is ``[(0, total)]``, so the caller records exactly what it
    would without splitting.  Counts are multiples of `step` (the last one excepted) where a
    step fits, else any count.  When one unit alone does not fit, BindingError names it
    (`unit`, with `detail` and what would help, `advice`, in parentheses) and the sizes.
    """
    total = int(total)
    slack = rt.storage_align - 4
    if scratch is None and total > 0 and fits_all(rt):
        return [(0, total)]

    def over(n: int):
        """The first (bytes, limit) that does not fit, else None."""
        for b in windows(n):
            if int(b) > rt.max_binding - slack:
                return int(b), rt.max_binding
        for b in (scratch(n) if scratch is not None else ()):
            if int(b) > rt.adapter_max_binding - slack:
                return int(b), rt.adapter_max_binding
        return None

    if total <= 0:
        return []
    if over(total) is None:
        return [(0, total)]
    bad = over(1)
    if bad is not None:
        raise BindingError(binding_refusal(_unit_text(unit, detail, advice), bad[0], bad[1], slack),
                           binding_refusal(_unit_text(unit, detail, None), bad[0], bad[1], slack))
    g = step if step > 1 and over(step) is None else 1
    lo, hi = 1, (total - 1) // g  # in units of g: lo fits; hi * g < total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if over(mid * g) is None:
            lo = mid
        else:
            hi = mid - 1
    n = lo * g
    return [(s, min(n, total - s)) for s in range(0, total, n)]


def fits_all(rt) -> bool:
    """True while every storage buffer made so far fits one binding: then no window of any
    of them can exceed it and nothing needs splitting (the fast path of `split`)."""
    return getattr(rt, "unsplit", False)


def binding_refusal(what: str, need: int, limit: int, slack: int) -> str:
    """'<what> needs N in one storage binding but the adapter allows M per binding' (exact
    bytes when the rounded figures would look equal: a binding starts on the offset
    alignment, so `slack` bytes of the limit may be lost)."""
    a, b = fmt_bytes(need), fmt_bytes(limit)
    if a == b:
        a, b = f"{need:,} bytes", f"{limit - slack:,} bytes (its {b} limit less the offset alignment)"
    return f"{what} needs {a} in one storage binding but the adapter allows {b} per binding"


def rows(t: Tensor, r0: int, n: int, width: int | None = None) -> Tensor:
    """Rows [r0, r0+n) of a row-major tensor of `width` elements per row (default: the size
    of its first dimension's rows); the tensor itself when that is all of it."""
    per = int(width) if width is not None else (t.numel // int(t.shape[0]) if t.shape and t.shape[0] else 1)
    if r0 == 0 and n * per == t.numel:
        return t
    out = Tensor(t.buffer, (int(n), per) if per > 1 else (int(n),), t.dtype, t.offset + t.itemsize * int(r0) * per, t.name)
    assert out.offset + out.nbytes <= t.offset + t.nbytes, "rows past the end of its tensor"
    return out


def span(t: Tensor, start: int, n: int) -> Tensor:
    """Elements [start, start+n) of t, flat."""
    out = Tensor(t.buffer, (int(n),), t.dtype, t.offset + t.itemsize * int(start), t.name)
    assert out.offset + out.nbytes <= t.offset + t.nbytes, "span past the end of its tensor"
    return out


class Runtime:
    """One WebGPU device plus caches. Create with `get_runtime()`."""

    def __init__(self, device: str = "auto", verbose: bool = False):
        import wgpu

        self.wgpu = wgpu
        self.verbose = verbose
        self.adapter = choose_adapter(device, verbose)
        info = self.adapter.info
        self.adapter_name = str(info.get("device", "unknown"))
        self.backend = str(info.get("backend_type", "unknown"))
        self.adapter_type = str(info.get("adapter_type", "unknown"))
        alim = self.adapter.limits
        want = {}
        for key in ("max-buffer-size", "max-storage-buffer-binding-size",
                    "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup",
                    "max-compute-workgroup-size-x", "max-compute-workgroup-size-y"):
            if key in alim:
                want[key] = alim[key]
        want["max-storage-buffers-per-shader-stage"] = min(alim.get("max-storage-buffers-per-shader-stage", 8),
                                                           STORAGE_BUFFERS)
        feats = []
        self.has_timestamps = "timestamp-query" in self.adapter.features
        if self.has_timestamps:
            feats.append("timestamp-query")
        # subgroup operations (shuffles within a SIMD group): kernels that use them go
        # through the helpers of shaders/subgroups.wgsl and keep a workgroup-memory path
        self.has_subgroups = "subgroup" in self.adapter.features
        if self.has_subgroups:
            feats.append("subgroup")
        # f16 arithmetic and storage in shaders (--precision mixed: the f16 matmul path)
        self.has_f16 = "shader-f16" in self.adapter.features
        self.shader_checks = os.environ.get(ENV_SHADER_CHECKS, "").strip() not in ("", "0")
        if self.has_f16:
            feats.append("shader-f16")
        self.features = set(self.adapter.features)
        with _silence_fd2(not verbose):
            self.device = self.adapter.request_device_sync(required_features=feats, required_limits=want)
        self.limits = dict(self.device.limits)
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
        self.bounded = True  # submit steps in pieces (Recorder.boundary); the trainer clears it for fast steps
        self.piece_depth = MIN_PIECES  # pieces kept queued while bounded; the trainer sets it from the step time
        self.pieces = 0  # pieces submitted at boundaries so far
        self.piece_span = 1  # boundaries per piece while bounded; the trainer sets it from the step time
        self.boundaries = 0  # boundaries passed while bounded so far
        self._since_piece = 0  # boundaries passed since the last submission
        # Recorder.copy / clear as dispatches (shaders/copy.wgsl) rather than buffer copies
        # and clears, which end the compute pass: on the H200 a step's 194 copies cost 1.4%
        # of it that way; on a CPU adapter a dispatch costs more than a pass break
        self.copy_by_dispatch = "cpu" not in _adapter_kind(info)
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
        """`unsplit`: every storage buffer made so far fits one binding (see gpu.fits_all)."""
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
        return f"{self.adapter_name} ({self.backend}, {self.adapter_type})"

    # optional adapter features that kernels may use where present (the plain path is the
    # reference); reported by `memengine info`
    OPTIONAL_FEATURES = ("timestamp-query", "subgroup", "shader-f16")

    def capabilities(self) -> dict:
        return {
            "features": [f for f in self.OPTIONAL_FEATURES if f in self.features],
            "max_storage_binding_bytes": self.max_binding,
            "max_buffer_bytes": self.max_buffer,
        }

    # ------------------------------------------------------------------ shaders
    # Every module gets shaders/common.wgsl (sigmoid, silu, softplus) put in front of it.
    # A shader whose first line is `// requires: a, b` gets shaders/a.wgsl and b.wgsl put
    # in front of it too; `subgroups` is shaders/subgroups.wgsl where the device has
    # subgroups, else the stand-ins of shaders/subgroups_off.wgsl (sg_size() == 1, so
    # kernels take their workgroup path).
    REQUIRES = "// requires:"

    def module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            path = _wgsl_path(name)
            try:
                code = path.read_text()
            except FileNotFoundError as e:
                raise RuntimeError(f"shader file not found: shaders/{name}.wgsl") from e
            prelude = [_wgsl_path("common").read_text()]
            lines = code.split("\n")
            if lines[0].startswith(self.REQUIRES):
                for req in lines[0][len(self.REQUIRES):].split(","):
                    req = req.strip()
                    if req == "subgroups" and not self.has_subgroups:
                        req = "subgroups_off"
                    prelude.append(_wgsl_path(req).read_text())
            # `enable ...;` directives (among the leading comments) go in front of everything
            head = 0
            while head < len(lines) and lines[head].startswith(("enable ", "//")):
                head += 1
            enables = [ln for ln in lines[:head] if ln.startswith("enable ")]
            code = "\n".join(enables + prelude + [ln for ln in lines if not ln.startswith("enable ")])
            try:
                mod = _create_module(self.device, name, code, self.shader_checks)
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
        u = self.wgpu.BufferUsage
        return u.STORAGE | u.COPY_SRC | u.COPY_DST

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
        nbytes = max(16, ((_ITEMSIZE.get(dtype, 4) * n + 15) // 16) * 16)
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
        a = np.ascontiguousarray(a, dtype=_DTYPES[dtype])
        t = self.empty(a.shape, dtype, name)
        self.write(t, a)
        return t

    def write(self, t: Tensor, array) -> None:
        a = np.ascontiguousarray(array, dtype=_DTYPES[t.dtype])
        assert a.size == t.numel, (a.shape, t.shape)
        if a.size:
            data = a.tobytes()
            if len(data) % 4:  # an odd number of f16 (writes are whole 4-byte words)
                data += bytes(2)
            self.device.queue.write_buffer(t.buffer, t.offset, data)

    def read(self, t: Tensor) -> np.ndarray:
        self.sync()  # the queued work first, interruptibly; then the copy back is short
        raw = self.device.queue.read_buffer(t.buffer, t.offset, (t.nbytes + 3) // 4 * 4)
        return np.frombuffer(raw, dtype=_DTYPES[t.dtype])[:t.numel].copy().reshape(t.shape)

    def uniform(self, data: bytes) -> Uniform:
        """A uniform buffer holding `data`, cached by content (created once per shape)."""
        if len(data) % 16:
            data = data + b"\0" * (16 - len(data) % 16)
        u = self._uniforms.get(data)
        if u is None:
            u = self.wgpu.BufferUsage
            buf = self.device.create_buffer_with_data(data=data, usage=u.UNIFORM | u.COPY_DST)
            u = Uniform(buf, 0, len(data))
            self._uniforms[data] = u
        return u

    def uniform_buffer(self, size: int) -> object:
        """A writable uniform buffer (for values that change per step)."""
        u = self.wgpu.BufferUsage
        return self.device.create_buffer(size=max(16, size), usage=u.UNIFORM | u.COPY_DST)

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
        self.profiler = _Profiler(self)
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

    def piece_fence(self) -> "StepFence":
        if self._piece_fence is None:
            self._piece_fence = StepFence(self, depth=self.piece_depth, slots=MAX_PIECES)
        self._piece_fence.depth = self.piece_depth
        return self._piece_fence

    def sync(self) -> None:
        """Wait until all submitted work is done (in slices, an interrupt acts at once)."""
        # (on_submitted_work_done_sync is unreliable across drivers; a mapped copy is not)
        if getattr(self, "_sync_buf", None) is None:
            u = self.wgpu.BufferUsage
            self._sync_src = self.empty((4,), "u32", "sync.src")
            self._sync_buf = self.device.create_buffer(label="sync", size=16, usage=u.MAP_READ | u.COPY_DST)
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(self._sync_src.buffer, 0, self._sync_buf, 0, 16)
        self.device.queue.submit([enc.finish()])
        wait_mapped(self._sync_buf, self.wgpu.MapMode.READ)


def grid(n_groups: int) -> tuple[int, int, int]:
    """Fold a 1-D count of workgroups into (x, y, 1) within the 65535 limit."""
    n_groups = max(1, int(n_groups))
    if n_groups <= MAX_GROUPS:
        return (n_groups, 1, 1)
    y = (n_groups + MAX_GROUPS - 1) // MAX_GROUPS
    x = (n_groups + y - 1) // y
    return (x, y, 1)


def dispatch_groups(groups) -> tuple | None:
    """(x, y, z) workgroup counts of a dispatch (an int is folded by grid()); None when
    there is nothing to run."""
    if isinstance(groups, int):
        groups = grid(groups)
    groups = tuple(int(g) for g in groups) + (1,) * (3 - len(groups))
    return groups if min(groups) > 0 else None


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pack(fmt: str, *values) -> bytes:
    """struct.pack with 16-byte padding, for uniform blocks ('I' = u32, 'f' = f32, 'i' = i32)."""
    data = struct.pack("<" + fmt, *values)
    if len(data) % 16:
        data += b"\0" * (16 - len(data) % 16)
    return data


class _Profiler:
    """Pairs of timestamp queries around single-dispatch compute passes."""

    SIZE = 4096

    def __init__(self, rt: "Runtime"):
        u = rt.wgpu.BufferUsage
        self.rt = rt
        self.qs = rt.device.create_query_set(type="timestamp", count=self.SIZE)
        self.resolve = rt.device.create_buffer(size=8 * self.SIZE, usage=u.QUERY_RESOLVE | u.COPY_SRC)
        self.labels: list = []
        self.pending: list = []
        self.totals: dict = {}

    def slot(self, label: str) -> int | None:
        if 2 * (len(self.labels) + 1) > self.SIZE:
            return None
        self.labels.append(label)
        return 2 * (len(self.labels) - 1)

    def resolve_into(self, encoder) -> None:
        n = 2 * len(self.labels)
        if n:
            encoder.resolve_query_set(self.qs, 0, n, self.resolve, 0)
            self.pending = self.labels
            self.labels = []

    def flush(self) -> None:
        if not self.pending:
            return
        n = 2 * len(self.pending)
        raw = np.frombuffer(self.rt.device.queue.read_buffer(self.resolve, 0, 8 * n), dtype=np.uint64)
        for i, label in enumerate(self.pending):
            dt = float(raw[2 * i + 1]) - float(raw[2 * i])
            cnt, tot = self.totals.get(label, (0, 0.0))
            self.totals[label] = (cnt + 1, tot + max(dt, 0.0))
        self.pending = []


def wait_mapped(buf, mode) -> None:
    """Map `buf` (waiting for the GPU work before it), then unmap it.  The wait is cut in
    short slices with an interrupt check between them: a Ctrl-C acts within a slice, not
    after the queued work (a long native wait would keep Python from running its handler)."""
    promise = buf.map_async(mode)
    done = getattr(promise, "_thread_event", None)
    if done is not None:
        while not done.wait(WAIT_SLICE_S):
            interrupts.check()
    promise.sync_wait()
    buf.unmap()


WAIT_SLICE_S = 0.05
# a step is submitted in pieces (a layer's forward or backward each) while steps are slow,
# so the GPU queue never holds more than a few pieces and an interrupt acts within one
BOUNDED_STEP_S = 0.25
# pieces queued ahead: as many as hold about QUEUED_PIECES_S of GPU work, 2 to 8.  Two
# starve a fast GPU while the host records the next piece (mamba-130m, B 8, L 2048 on the
# H200: 37,235 tokens/s with 2, 37,781 with 4, 38,050 with 8; benchmarks/README.md)
QUEUED_PIECES_S = 0.1
MIN_PIECES, MAX_PIECES = 2, 8
# a piece spans as many boundaries (a layer's forward or backward, an LM-head chunk) as hold
# about PIECE_S of GPU work: each submission costs the GPU time (H200, mamba-130m B 8 L 2048,
# 61 boundaries of 6.6 ms: 40,616 / 40,640 tokens/s with a piece at each, 40,895 / 40,904 at
# every second, 40,949 / 40,992 at every fourth; benchmarks/README.md)
PIECE_S = 0.03


def piece_depth(step_s: float, pieces: int) -> int:
    """Pieces to keep queued when a step of `step_s` seconds is submitted in `pieces`."""
    per_piece = step_s / max(1, pieces)
    return int(min(MAX_PIECES, max(MIN_PIECES, QUEUED_PIECES_S // max(per_piece, 1e-9))))


def piece_span(step_s: float, boundaries: int) -> int:
    """Layer boundaries per piece when a step of `step_s` seconds has `boundaries`."""
    return max(1, int(PIECE_S // max(step_s / max(1, boundaries), 1e-9)))


class StepFence:
    """Bounds how many submitted steps may be queued on the GPU, without stalling it.

    Each step ends by copying 16 bytes into one of `depth` small mappable buffers; before
    step i is recorded, the buffer of step i-depth is mapped, which waits for that step
    only (the later ones keep the GPU busy).  Nothing is read: the progress a loop reports
    then tracks the GPU within `depth` steps, and an interrupted run stops within `depth`
    steps instead of after everything queued.
    """

    def __init__(self, rt: "Runtime", depth: int = 3, slots: int = 0):
        """`slots` (at least `depth`): buffers in the ring, so that `depth` may be changed
        later up to that many without making new ones."""
        u = rt.wgpu.BufferUsage
        self.rt = rt
        self.depth = max(1, int(depth))
        self.src = rt.empty((4,), "u32", "fence.src")
        self.bufs = [rt.device.create_buffer(label=f"fence{i}", size=16, usage=u.MAP_READ | u.COPY_DST)
                     for i in range(max(self.depth, int(slots)))]
        self.steps = 0

    def wait(self) -> None:
        """Call before recording a step: waits for the step `depth` back to finish."""
        if self.steps >= self.depth:
            wait_mapped(self.bufs[(self.steps - self.depth) % len(self.bufs)], self.rt.wgpu.MapMode.READ)

    def mark(self, rec: "Recorder") -> None:
        """Call after recording a step, before its submit."""
        rec._end_pass()
        rec.encoder.copy_buffer_to_buffer(self.src.buffer, 0, self.bufs[self.steps % len(self.bufs)], 0, 16)
        self.steps += 1


class Recorder:
    """Records dispatches into one command encoder; `submit()` sends them as one batch."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.encoder = rt.device.create_command_encoder()
        self._pass = None
        self.dispatches = 0

    def _compute_pass(self):
        if self._pass is None:
            self._pass = self.encoder.begin_compute_pass()
        return self._pass

    def _end_pass(self):
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def dispatch(self, shader: str, entry: str, bindings: dict, groups, constants: dict | None = None):
        groups = dispatch_groups(groups)
        if groups is None:
            return
        pl = self.rt.pipeline(shader, entry, constants)
        bg = self.rt.bind_group(pl, bindings)
        prof = getattr(self.rt, "profiler", None)
        if prof is not None:
            if prof.pending:
                prof.flush()
            i = prof.slot(f"{shader}.{entry}")
            if i is not None:
                self._end_pass()
                p = self.encoder.begin_compute_pass(timestamp_writes={
                    "query_set": prof.qs, "beginning_of_pass_write_index": i, "end_of_pass_write_index": i + 1})
                p.set_pipeline(pl)
                p.set_bind_group(0, bg)
                p.dispatch_workgroups(*groups)
                p.end()
                self.dispatches += 1
                return
        p = self._compute_pass()
        p.set_pipeline(pl)
        p.set_bind_group(0, bg)
        p.dispatch_workgroups(*groups)
        self.dispatches += 1

    def clear(self, t: Tensor):
        if t.nbytes:
            size = t.nbytes
            if (t.offset % 4) or (size % 4):
                raise ValueError("clear needs 4-byte alignment")
            if self.rt.copy_by_dispatch and self._storage(t):
                self._words("clear_words", None, t)
                return
            self._end_pass()
            self.encoder.clear_buffer(t.buffer, t.offset, size)

    def copy(self, src: Tensor, dst: Tensor, slot: bool = False):
        """dst = src.  `slot`: dst (or src) is one of many slots of a buffer, a different one
        at each call (a trace, a ring): a buffer copy then, as a dispatch would make a
        binding and uniform per slot."""
        assert src.nbytes == dst.nbytes
        if src.nbytes:
            if (self.rt.copy_by_dispatch and not (slot or src.offset % 4 or dst.offset % 4 or src.nbytes % 4)
                    and self._storage(src) and self._storage(dst)):
                self._words("copy_words", src, dst)
                return
            self._end_pass()
            self.encoder.copy_buffer_to_buffer(src.buffer, src.offset, dst.buffer, dst.offset, src.nbytes)

    def _storage(self, t: Tensor) -> bool:
        return bool(t.buffer.usage & self.rt.wgpu.BufferUsage.STORAGE)

    def _words(self, entry: str, src: Tensor | None, dst: Tensor):
        """dst = src (or zeros) by shaders/copy.wgsl, as 32-bit words, in windows that fit a
        binding; the compute pass goes on (see Runtime.copy_by_dispatch)."""
        rt = self.rt
        total = dst.nbytes // 4
        step = max(1, (rt.max_binding - rt.storage_align) // 4)
        for i in range(0, total, step):
            n = min(step, total - i)
            bd, od = bound(rt, Tensor(dst.buffer, (n,), "u32", dst.offset + 4 * i))
            bindings = {0: bd}
            os_ = 0
            if src is not None:
                bindings[1], os_ = bound(rt, Tensor(src.buffer, (n,), "u32", src.offset + 4 * i))
            bindings[2] = rt.uniform(pack("4I", n, os_, od, 0))
            self.dispatch("copy", entry, bindings, cdiv(n, 256))

    def boundary(self):
        """A point where the recorded work may be submitted (between layers): while the
        runtime bounds its submissions (`Runtime.bounded`), submit it at every
        `Runtime.piece_span`-th boundary and keep at most `Runtime.piece_depth` pieces
        queued, checking for an interrupt while waiting."""
        rt = self.rt
        if not rt.bounded or not self.dispatches:
            return
        rt.boundaries += 1
        rt._since_piece += 1
        if rt._since_piece < rt.piece_span:
            return
        fence = rt.piece_fence()
        fence.wait()
        fence.mark(self)
        self.submit()
        rt.pieces += 1
        interrupts.check()

    def submit(self):
        self._end_pass()
        prof = getattr(self.rt, "profiler", None)
        if prof is not None:
            prof.resolve_into(self.encoder)
        self.rt.device.queue.submit([self.encoder.finish()])
        if prof is not None:
            prof.flush()
        self.encoder = self.rt.device.create_command_encoder()
        self.dispatches = 0
        self.rt._since_piece = 0


_RUNTIMES: dict = {}


def get_runtime(device: str | None = None, verbose: bool = False) -> Runtime:
    """The process-wide runtime for a device request (MEMENGINE_DEVICE when None)."""
    request = device or os.environ.get("MEMENGINE_DEVICE", "auto")
    rt = _RUNTIMES.get(request)
    if rt is None:
        rt = Runtime(request, verbose)
        _RUNTIMES[request] = rt
    else:
        rt.apply_env_limits()
    return rt
