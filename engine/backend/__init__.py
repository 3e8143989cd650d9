"""GPU backends: the one place that talks to a WebGPU implementation.

The runtime (engine/runtime) asks a `Backend` for what differs between implementations:
the adapters and the choice among them, the device (features, limits), shader modules
(trusted or checked), buffer usage flags and map modes, waits on mapped buffers, the WGSL
dialect (enable directives) and the spelling of feature names.  Everything else goes
through the objects a backend hands back (device, queue, buffers, command encoders,
compute passes, pipelines, bind groups), which follow wgpu-py's object API
(`device.create_buffer(label=, size=, usage=)`, `device.create_command_encoder()`,
`device.queue.submit / write_buffer / read_buffer`, `buffer.map_async / map_sync /
read_mapped / unmap`, `encoder.begin_compute_pass()` ...); a backend over another binding
wraps its objects to match.

`get_backend(name)` returns the backend registered under `name` ("wgpu": wgpu-native
through wgpu-py, `wgpu_native.py`; "dawn": Dawn through wgpudawn, `dawn.py`, an extra:
`memengine[dawn]`); `open_adapter(request, device)` resolves `--backend auto|wgpu|dawn`
(MEMENGINE_BACKEND) to a backend and one of its adapters.  Only the modules of this
package import a WebGPU binding.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile

from memengine.engine.errors import NoAdapterError

# the runtime's names of the optional features it asks for (see Backend.FEATURES)
TIMESTAMPS, SUBGROUPS, SHADER_F16 = "timestamp-query", "subgroups", "shader-f16"
# subgroup matrices (Dawn's chromium-experimental-subgroup-matrix): only a backend whose
# FEATURES spells it has them
SUBGROUP_MATRIX = "subgroup-matrix"
# --backend's values (MEMENGINE_BACKEND); auto: Dawn for --precision mixed where wgpudawn is
# installed and the adapter has f16 subgroup matrices (tensor cores from WGSL), else wgpu-native
AUTO = "auto"
BACKENDS = (AUTO, "wgpu", "dawn")
ENV_BACKEND = "MEMENGINE_BACKEND"
# a wait on the GPU is cut into slices this long with an interrupt check between them
WAIT_SLICE_S = 0.05

NO_ADAPTER_HINT = (
    "no WebGPU adapter found; on a machine without a GPU install Mesa's software "
    "Vulkan driver (Debian/Ubuntu: apt-get install -y mesa-vulkan-drivers)"
)


def adapter_kind(info: dict) -> str:
    """'discretegpu', 'integratedgpu', 'virtualgpu', 'cpu' ... (lower case) of an adapter's info."""
    return str(info.get("adapter_type", "")).lower()


@contextlib.contextmanager
def silence_fd2(enabled: bool):
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


class Backend:
    """What the runtime needs from a WebGPU implementation.  A subclass sets the class
    attributes and implements the methods that raise NotImplementedError here."""

    name = ""
    label = ""  # how the run's adapter line names it ("... via Dawn")
    # the one line a request for an adapter of this backend gets when there is none
    NO_ADAPTER_HINT = NO_ADAPTER_HINT
    # buffer usage flags (combined with |) and the read map mode, in the binding's values
    STORAGE = UNIFORM = COPY_SRC = COPY_DST = MAP_READ = QUERY_RESOLVE = 0
    MAP_MODE_READ = 0
    # the runtime's feature names (TIMESTAMPS, SUBGROUPS, SHADER_F16) -> this backend's
    FEATURES: dict = {TIMESTAMPS: TIMESTAMPS, SUBGROUPS: SUBGROUPS, SHADER_F16: SHADER_F16}
    # the directive a module that uses subgroup operations starts with (None: the WGSL
    # compiler takes them without one)
    SUBGROUPS_ENABLE: str | None = "enable subgroups;"

    # ---------------------------------------------------------------- adapters
    def quiet(self, verbose: bool) -> None:
        """Keep driver chatter off stderr unless the user asked for it.  Mesa's "XDG_RUNTIME_DIR
        is invalid or not set", which reads like an error and is none, goes in either case:
        a private runtime directory is made when the variable names none."""
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if not xdg or not os.path.isdir(xdg):
            d = os.path.join(tempfile.gettempdir(), f"memengine-runtime-{os.getuid()}")
            os.makedirs(d, mode=0o700, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(d, 0o700)
            os.environ["XDG_RUNTIME_DIR"] = d

    def adapters(self) -> list:
        """Every adapter the implementation finds."""
        raise NotImplementedError

    # the adapter's facts as the wgpu-py API gives them (wgpu-native's and wgpudawn's alike)
    def adapter_info(self, adapter) -> dict:
        """'device', 'description', 'vendor', 'adapter_type', 'backend_type' of an adapter."""
        return adapter.info

    def adapter_features(self, adapter) -> set:
        """The adapter's features, in this backend's spelling."""
        return set(adapter.features)

    def adapter_limits(self, adapter) -> dict:
        """The adapter's limits, by WebGPU's kebab-case names ('max-buffer-size' ...)."""
        return adapter.limits

    def device_memory(self, adapter) -> int | None:
        """Bytes of the adapter's largest device-local memory heap, where the implementation
        says (WebGPU itself gives no memory size); None elsewhere."""
        return None

    def choose_adapter(self, request: str = "auto", verbose: bool = False):
        """Pick an adapter: 'auto' (best), 'gpu' (real GPU only), 'cpu' (software), or a
        case-insensitive substring of the adapter's name; 'auto:K' (a rank of a multi-rank
        run, K its local rank): the K-th hardware GPU (modulo their number), else the best."""
        self.quiet(verbose)
        request = (request or "auto").strip()
        nth = None
        if request.lower().startswith("auto:") and request[5:].isdigit():
            request, nth = "auto", int(request[5:])
        with silence_fd2(not verbose):
            try:
                adapters = self.adapters()
            except Exception as e:
                adapters = []
                if verbose:
                    logging.getLogger("memengine").warning("adapter enumeration failed: %s", e)
        if not adapters:
            raise NoAdapterError(self.NO_ADAPTER_HINT)
        infos = {id(a): self.adapter_info(a) for a in adapters}

        def score(a):
            info = infos[id(a)]
            kind = adapter_kind(info)
            backend = str(info.get("backend_type", "")).lower()
            s = {"discretegpu": 40, "integratedgpu": 30, "virtualgpu": 20, "cpu": 10}.get(kind, 0)
            s += {"vulkan": 5, "metal": 5, "d3d12": 4, "opengl": 1}.get(backend, 0)
            return s

        def names():
            return ", ".join(sorted({infos[id(a)].get("device", "?") for a in adapters}))

        req = request.lower()
        if req == "auto" and nth is not None:
            gpus = [a for a in adapters if adapter_kind(infos[id(a)]) != "cpu"]
            if gpus:
                best = max(score(a) for a in gpus)
                gpus = [a for a in gpus if score(a) == best]   # one kind, in enumeration order
                return gpus[nth % len(gpus)]
            cands = adapters
        elif req == "auto":
            cands = adapters
        elif req == "gpu":
            cands = [a for a in adapters if adapter_kind(infos[id(a)]) != "cpu"]
            if not cands:
                raise NoAdapterError(f"--device gpu: no hardware GPU adapter (found: {names()}); "
                                     "use --device auto or cpu")
        elif req == "cpu":
            cands = [a for a in adapters if adapter_kind(infos[id(a)]) == "cpu"]
            if not cands:
                raise NoAdapterError("--device cpu: no software adapter found; " + NO_ADAPTER_HINT.split("; ", 1)[1])
        else:
            cands = [a for a in adapters
                     if any(req in str(infos[id(a)].get(k, "")).lower() for k in ("device", "description", "vendor"))]
            if not cands:
                raise NoAdapterError(f"--device {request!r} matches no adapter (found: {names()})")
        return max(cands, key=score)

    # ---------------------------------------------------------------- device
    def has_f16_subgroup_matrices(self, adapter) -> bool:
        """Whether the adapter multiplies f16 subgroup matrices into f32 ones at 16x16x16 in
        subgroups of 32 (tensor cores from WGSL: shaders/matmul_sgmat.wgsl; what
        `--backend auto` takes Dawn for)."""
        return False

    def request_device(self, adapter, features: list, limits: dict, verbose: bool = False, checks: bool = False):
        """A device with `features` (this backend's spelling) and `limits` (kebab-case);
        `checks`: its shader modules keep the WGSL compiler's run-time checks (see
        create_module; a backend that sets them per device does it here)."""
        raise NotImplementedError

    def device_limits(self, device) -> dict:
        """The device's limits, by WebGPU's kebab-case names."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shaders
    def enables(self, directives: list, subgroups: bool) -> list:
        """The `enable ...;` lines a module starts with: the shader's own `directives` and,
        where it uses subgroup operations (`subgroups`), the backend's directive for them."""
        if subgroups and self.SUBGROUPS_ENABLE and self.SUBGROUPS_ENABLE not in directives:
            return [*directives, self.SUBGROUPS_ENABLE]
        return list(directives)

    def create_module(self, device, label: str, code: str, checks: bool):
        """A shader module; without `checks`, compiled without the WGSL compiler's run-time
        checks (index clamping, loop bounding) where the implementation can."""
        raise NotImplementedError

    # ---------------------------------------------------------------- mapping
    def wait_mapped(self, buf, mode) -> None:
        """Map `buf` (waiting for the GPU work before it), then unmap it, with
        `interrupts.check()` at least every WAIT_SLICE_S while waiting."""
        raise NotImplementedError

    def read_mapped(self, buf) -> bytes:
        """The bytes of a MAP_READ buffer once the GPU work before it is done."""
        buf.map_sync(self.MAP_MODE_READ)
        try:
            return bytes(buf.read_mapped())
        finally:
            buf.unmap()


# name -> module whose `BACKEND` class implements it (imported when first asked for, so
# that importing this package loads no binding)
REGISTRY = {"wgpu": "memengine.engine.backend.wgpu_native", "dawn": "memengine.engine.backend.dawn"}
DEFAULT = "wgpu"
# what brings a backend's binding where it is missing
INSTALL = {"wgpu": "pip install memengine", "dawn": "pip install 'memengine[dawn]' (wgpudawn)"}
_MADE: dict = {}


def get_backend(name: str | None = None) -> Backend:
    """The backend registered under `name` (None: DEFAULT), made once per process."""
    name = name or DEFAULT
    b = _MADE.get(name)
    if b is None:
        if name not in REGISTRY:
            raise NoAdapterError(f"unknown GPU backend {name!r} (known: {', '.join(sorted(REGISTRY))})")
        try:
            mod = importlib.import_module(REGISTRY[name])
        except ImportError as e:
            raise NoAdapterError(f"the {name} backend is not installed ({e}); {INSTALL.get(name, 'pip install memengine')}"
                                 ) from e
        except Exception as e:  # pragma: no cover
            raise NoAdapterError(f"cannot load the {name} backend ({e})") from e
        b = _MADE[name] = mod.BACKEND()
    return b


def backend_request(request: str | None = None) -> str:
    """--backend's value: `request`, else MEMENGINE_BACKEND, else auto (lower case)."""
    return (request or os.environ.get(ENV_BACKEND, "").strip() or AUTO).strip().lower()


def open_adapter(request: str | None = None, device: str = "auto", verbose: bool = False,
                 tensor_cores: bool = False, found: dict | None = None) -> tuple:
    """(backend, adapter) for `--backend request --device device`.

    auto: Dawn where its binding loads, the adapter it would pick for `device` has f16
    subgroup matrices and the run multiplies on them (`tensor_cores`: --precision mixed),
    else wgpu-native (whose fp32 step ran 1.11x Dawn's on the H200: README, the Dawn
    backend).  `found`, where given, gets `dawn_tensor_cores`: whether auto saw such an
    adapter under Dawn.  wgpu / dawn: that backend, whose refusal (binding not installed,
    no adapter it can run on) is one NoAdapterError line naming --backend."""
    asked = backend_request(request)
    if asked not in REGISTRY and asked != AUTO:
        raise NoAdapterError(f"--backend {asked}: must be one of {', '.join(BACKENDS)}")
    if asked == AUTO:
        try:
            dawn = get_backend("dawn")
            adapter = dawn.choose_adapter(device, verbose)
            matrices = dawn.has_f16_subgroup_matrices(adapter)
            if found is not None:
                found["dawn_tensor_cores"] = matrices
            if matrices and tensor_cores:
                return dawn, adapter
        except Exception:  # not installed, no adapter, or Dawn failing: wgpu-native serves
            pass
    name = DEFAULT if asked == AUTO else asked
    try:
        b = get_backend(name)
        return b, b.choose_adapter(device, verbose)
    except NoAdapterError as e:
        if asked == AUTO:
            raise
        raise NoAdapterError(f"--backend {name}: {e}") from e

