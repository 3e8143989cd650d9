"""WebGPU runtime: shader/pipeline cache, pooled buffers, dispatch recording, pacing.

The GPU itself is reached through a backend (engine/backend: adapters, device, shader
modules, buffer flags, mapped waits); the modules here are split by concern:
tensor.py (Tensor, Uniform, views, grids), ranges.py (`split`: calls over tensors larger
than one binding), runtime.py (Runtime, get_runtime: caches, pool, limits, the WGSL
linker), recorder.py (Recorder, StepFence, Program), pacing.py (Pacer: a step submitted in
pieces), profiler.py (timestamp queries), settings.py (KernelSettings: the kernels'
switches).  The names below are their public ones.

Conventions every kernel wrapper follows:

* A `Tensor` is a view of a pooled GPU buffer: shape, element type ("f32", "u32",
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

from memengine.engine.hostmem import fmt_bytes  # noqa: F401  (the ops and the plan format sizes with it)
from memengine.engine.runtime.pacing import (  # noqa: F401
    BOUNDED_STEP_S,
    MAX_PIECES,
    MIN_PIECES,
    PIECE_S,
    QUEUED_PIECES_S,
    Pacer,
    piece_depth,
    piece_span,
)
from memengine.engine.runtime.profiler import Profiler  # noqa: F401
from memengine.engine.runtime.ranges import BindingError, binding_refusal, fits_all, largest, split  # noqa: F401
from memengine.engine.runtime.recorder import Program, Recorder, StepFence  # noqa: F401
from memengine.engine.runtime.runtime import (  # noqa: F401
    ENV_BACKEND,
    ENV_MAX_BINDING,
    ENV_MAX_BUFFER,
    ENV_SHADER_CHECKS,
    MIN_FORCED_LIMIT,
    STORAGE_BUFFERS,
    Runtime,
    env_bytes,
    get_runtime,
    parse_bytes,
)
from memengine.engine.runtime.settings import ENV_MATMUL, KernelSettings  # noqa: F401
from memengine.engine.runtime.tensor import (  # noqa: F401
    DTYPES,
    ITEMSIZE,
    MAX_GROUPS,
    Tensor,
    Uniform,
    bound,
    cdiv,
    dispatch_groups,
    grid,
    pack,
    rows,
    span,
)
