"""Memory plan of a run: what `eval`, `train` or `adapt` will allocate, checked before any upload.

WebGPU tells a program two limits and no memory size: the largest buffer
(`max_buffer_size`) and the largest storage binding (`max_storage_buffer_binding_size`).
The plan checks, for a batch of B windows of L tokens:

1. every single buffer fits the largest buffer: each parameter tensor (the parameter and
   gradient stores take as many buffers as they need, but one tensor cannot be cut), each
   moment and each activation;
2. every unit of work the kernels cannot split fits one storage binding: one row of the
   embedding table and of the logits, one sequence of the conv1d and selective scan, the
   embedding's scatter plan (everything larger is processed in ranges);
3. the total fits the memory budget when there is one: `MEMENGINE_MAX_MEMORY_BYTES` when
   set; else, for a CPU adapter (lavapipe, llvmpipe: its buffers are host memory), the
   host memory available (`hostmem.available_bytes`: MemAvailable, else the physical
   size); for a GPU under Dawn its memory size (the largest device-local memory heap Dawn
   reports); for a GPU under wgpu-native no budget is known, so only 1 and 2 are checked and
   the total is reported.

A refusal is one line naming the figure and the flag that would help: the largest
--batch-size or --seq-len that passes all three checks, and no flag at all when the
weights alone (parameters, gradients, moments) do not fit: no flag can shrink those.

The figures mirror what the code allocates: the parameter store layout
(`models.store.store_layout`), the workspace table (`models.lm.workspace_shapes`: the shell's
buffers and the architecture's `Block.workspace_table`), the moments, and the kernels'
scratch: the shell's (split-K partial products, reduction partials, the evaluation's sums)
and the architecture's own (`Architecture.plan_scratch`, `plan_units`, `products`: for
Mamba-1 the scan's work and the conv's weight-gradient partials).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memengine.engine import hostmem, models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import rmsnorm
from memengine.engine.kernels.lanes import cpu_lanes
from memengine.engine.kernels.matmul import F16_TABLE_REGIONS, f16_split, splitk_slices
from memengine.engine.models.lm import f16_slot_names, logits_chunk_rows, workspace_shapes
from memengine.engine.models.store import store_layout
from memengine.engine.runtime import KernelSettings, binding_refusal, cdiv, env_bytes, fmt_bytes, largest
from memengine.engine.train.trainer import eval_group

KINDS = ("eval", "train", "adapt")
ENV_MAX_MEMORY = "MEMENGINE_MAX_MEMORY_BYTES"


@dataclass
class Limits:
    """What a plan is checked against (attribute names as on `gpu.Runtime`, so `gpu.split`
    and the ops' sizing helpers accept it)."""

    max_buffer: int
    max_binding: int
    storage_align: int = 256
    adapter_max_binding: int = 0
    memory: int | None = None        # bytes a run may use in all; None: not known
    memory_source: str = "unknown (a GPU reports no memory size)"
    lanes: bool = False              # the 8-lane kernels run (ops/lanes.py: CPU adapters)
    has_subgroup_matrix: bool = False   # --precision mixed's kernels run on f16 subgroup matrices
    kernels: KernelSettings = field(default_factory=KernelSettings.from_env)  # the runtime's switches

    def __post_init__(self):
        self.adapter_max_binding = self.adapter_max_binding or self.max_binding

    @classmethod
    def of(cls, rt) -> "Limits":
        memory, source = memory_budget(getattr(rt, "adapter_type", ""), getattr(rt, "device_memory", None))
        return cls(rt.max_buffer, rt.max_binding, rt.storage_align, rt.adapter_max_binding, memory, source,
                   cpu_lanes(rt), bool(getattr(rt, "has_subgroup_matrix", False)), rt.kernels)

    def to_dict(self) -> dict:
        return {"max_buffer_bytes": self.max_buffer, "max_binding_bytes": self.max_binding,
                "memory_bytes": self.memory, "memory_source": self.memory_source}


def memory_budget(adapter_type: str, device_memory: int | None = None) -> tuple[int | None, str]:
    """(bytes, where the figure comes from) a run may use, or (None, why unknown).
    `device_memory`: the GPU's memory size where the backend tells it (`Runtime.device_memory`,
    Dawn's memory heaps)."""
    forced = env_bytes(ENV_MAX_MEMORY)
    if forced is not None:
        return forced, ENV_MAX_MEMORY
    if str(adapter_type).lower() == "cpu":  # its buffers are host memory
        avail, source = hostmem.available_bytes()
        if avail is not None:
            return avail, f"host memory, {source}"
    if device_memory:
        return int(device_memory), "the GPU's memory (its largest device-local heap, as Dawn reports it)"
    return None, ("unknown (this GPU's backend reports no memory size: --backend dawn does; "
                  "set MEMENGINE_MAX_MEMORY_BYTES to check one)")


def _buf(nbytes: int) -> int:
    """Bytes `Runtime.empty` allocates for nbytes (16-byte multiples)."""
    return max(16, (int(nbytes) + 15) // 16 * 16)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class MemoryPlan:
    """The memory plan of one run (what it allocates, the units that must fit one binding,
    the problems); not the listener's `Plan` of a training run's steps."""

    kind: str
    batch_size: int
    seq_len: int
    parts: dict = field(default_factory=dict)     # parameters, gradients, ... -> bytes
    buffers: list = field(default_factory=list)   # (what, bytes, grows with B x L)
    units: list = field(default_factory=list)     # (what, bytes, grows with B x L, limit kind)
    problems: list = field(default_factory=list)  # (message, grows with B x L)
    eval_passes: tuple = ()                       # batches of each evaluation pass
    trace_steps: int = 1
    mixed: bool = False                           # --precision mixed

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    @property
    def fixed(self) -> int:
        """Bytes that no --batch-size or --seq-len changes."""
        return int(sum(self.parts.get(k, 0) for k in ("parameters", "gradients", "moments")))

    @property
    def ok(self) -> bool:
        return not self.problems

    def largest_buffer(self) -> tuple[str, int]:
        return max(((w, b) for w, b, _ in self.buffers), key=lambda x: x[1], default=("", 0))

    def largest_unit(self) -> tuple[str, int]:
        return max(((w, b) for w, b, _, k in self.units if k == "tensor"), key=lambda x: x[1], default=("", 0))

    def to_dict(self) -> dict:
        lb, lu = self.largest_buffer(), self.largest_unit()
        return {"kind": self.kind, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "bytes": dict(self.parts), "total_bytes": self.total,
                "largest_buffer": {"what": lb[0], "bytes": lb[1]},
                "largest_unsplittable_binding": {"what": lu[0], "bytes": lu[1]},
                "ok": self.ok, "problem": self.problems[0][0] if self.problems else None}


def _trainable(cfg, kind: str, names: list) -> list:
    if kind == "train":
        return list(names)
    if kind == "adapt":
        return models.of(cfg).wsla_names(cfg, names)
    return []


def _store_bytes(shapes: dict, lim: Limits, item: int = 4) -> int:
    """Bytes of a FlatStore of `shapes` (model.store_layout: aligned views, segments); `item`
    2: of its f16 copy (lm.Half: each segment rounded up to 4 elements)."""
    _, segments = store_layout(shapes, lim.storage_align // 4, lim.max_buffer)
    return sum(4 * n if item == 4 else item * ((n + 3) // 4 * 4) for n in segments)


def _splitk_scratch(lim: Limits, products: set, mixed: bool = False) -> int:
    """Bytes of the split-K partial products (one scratch per product shape that splits;
    none where matmul_lanes takes the products).  `mixed`: the products whose shapes take
    f16 operands (K and N multiples of 4) split as the f16 kernels do, on any adapter."""
    total = 0
    for M, N, K in products:
        if mixed and K % 4 == 0 and N % 4 == 0:
            _, slices, _ = f16_split(lim, M, N, K)
        elif lim.lanes:
            continue
        else:
            slices, _ = splitk_slices(lim, M, N, K)
        if slices > 1:
            total += _buf(4 * slices * M * N)
    return total


def default_eval_passes(kind: str) -> tuple:
    """Batches per evaluation pass when the data is not known (`memengine info`): one batch
    for eval and adapt (adapt measures perplexity before and after), none for train (no
    held-out data)."""
    return () if kind == "train" else (1,)


# how a plan's problems name a sequence's length: the flag of eval, train and adapt
SEQUENCE = "at --seq-len {}"


def estimate(cfg, batch_size: int, seq_len: int, kind: str, lim: Limits,
             eval_passes: tuple | None = None, trace_steps: int = 1, adapter: tuple | None = None,
             sequence: str = SEQUENCE, mixed: bool = False) -> MemoryPlan:
    """The plan of one run (see the module docstring); problems are filled in.

    `eval_passes`: the number of batches of each distinct evaluation the run makes (eval:
    its data; adapt: its data, and held-out data if any; train: held-out data if any), for
    the per-window sums (12 bytes a window); None: `default_eval_passes`.  `trace_steps`:
    the steps a trainer's loss/norm trace holds (engine/loop.reads_apart).  `adapter`:
    (tensor sizes, widths of its per-row buffers) of a LoRA adapter applied (lora.plan_sizes);
    kind "lora" trains it: no gradient store for the base, moments for the adapter only.
    `sequence`: how the problems name one sequence's length ("{}": the length), by default
    the flag that sets it.  `mixed`: under --precision mixed (the f16 copies, their scratch)."""
    if kind not in KINDS + ("lora",):
        raise ValueError(f"kind must be one of {KINDS + ('lora',)}")
    B, L = int(batch_size), int(seq_len)
    passes = default_eval_passes(kind) if eval_passes is None else tuple(int(n) for n in eval_passes)
    plan = MemoryPlan(kind, B, L, eval_passes=passes, trace_steps=int(trace_steps), mixed=bool(mixed))
    a_sizes, a_rows = adapter or ((), ())
    shapes = models.of(cfg).shapes(cfg)
    _weights(plan, cfg, shapes, lim, a_sizes)
    _activations(plan, cfg, lim, a_rows, mixed)
    plan.parts["scratch"] = _scratch(plan, cfg, shapes, lim, a_sizes, mixed)
    _units(plan, cfg, sequence)
    _check(plan, lim)
    return plan


def _weights(plan: MemoryPlan, cfg, shapes: dict, lim: Limits, a_sizes: tuple) -> None:
    """The parameter (and gradient) stores and the moments."""
    for name, shape in shapes.items():
        plan.buffers.append((f"tensor {name}", 4 * _numel(shape), False))
    try:
        store = _store_bytes(shapes, lim)
    except MemengineError as e:
        plan.problems.append((str(e), False))
        store = sum(4 * _numel(s) for s in shapes.values())
    # an adapter's store: its tensors one after the other, each aligned for binding
    a_store = _buf(4 * sum(-(-n // (lim.storage_align // 4)) * (lim.storage_align // 4) for n in a_sizes))
    plan.parts["parameters"] = store + (a_store if a_sizes else 0)
    if plan.mixed:   # the parameters' f16 copy (lm.Half)
        try:
            plan.parts["parameters"] += _store_bytes(shapes, lim, 2)
        except MemengineError:
            pass   # the problem is the f32 store's, said above
    # a store that trains whole has one flat moment pair per segment (optim.AdamW), else one
    # pair per trained tensor; the gradient store holds the trained tensors only
    trained = _trainable(cfg, plan.kind, list(shapes))
    if plan.kind == "lora":
        plan.parts["gradients"], plan.parts["moments"] = (a_store if a_sizes else 0), 2 * a_store
    elif len(trained) == len(shapes):
        plan.parts["gradients"], plan.parts["moments"] = store, 2 * store
    else:
        plan.parts["gradients"] = _store_bytes({n: shapes[n] for n in trained}, lim) if trained else 0
        plan.parts["moments"] = sum(2 * _buf(4 * _numel(shapes[n])) for n in trained)


_ITEM = {"f16": 2}   # bytes an element, where not 4


def _activations(plan: MemoryPlan, cfg, lim: Limits, a_rows: tuple, mixed: bool = False) -> None:
    """The workspace (adapt also evaluates before training: a light workspace as well)."""
    B, L, kind = plan.batch_size, plan.seq_len, plan.kind
    acts = logits = 0
    for g in ((False, True) if kind == "adapt" else (kind != "eval",)):
        for name, (shape, dtype, copies) in workspace_shapes(cfg, B, L, g, lim.max_binding, mixed).items():
            nbytes = _buf(_ITEM.get(dtype, 4) * _numel(shape))
            if name == "logits":
                logits += nbytes
                plan.buffers.append(("the logits chunk", nbytes, True))
                continue
            acts += copies * nbytes
            plan.buffers.append((f"activation {name} [{' x '.join(map(str, shape))}]",
                                 _ITEM.get(dtype, 4) * _numel(shape), True))
    plan.parts["activations"] = acts + sum(_buf(4 * B * L * w) for w in a_rows)
    plan.parts["logits chunk"] = logits


def _scratch(plan: MemoryPlan, cfg, shapes: dict, lim: Limits, a_sizes: tuple, mixed: bool = False) -> int:
    """The kernels' scratch: the layers' own (the architecture's table), then the shell's."""
    B, L, kind = plan.batch_size, plan.seq_len, plan.kind
    M, E, V = B * L, cfg.hidden_size, cfg.vocab_size
    grad = kind != "eval"
    arch = models.of(cfg)
    scratch = arch.plan_scratch(lim, cfg, B, L, kind, mixed=mixed)
    if mixed:   # the f16 scales' table (matmul.F16Scales), the unit loss scale; a trainer's loss scaler
        scratch += _buf(4 * F16_TABLE_REGIONS * len(f16_slot_names(cfg, arch.block(cfg)))) + _buf(4)
        scratch += (_buf(4) + _buf(16)) if grad else 0
    scratch += _buf(4)  # the final norm's unused copy binding (kernels/rmsnorm.py)
    chunk = logits_chunk_rows(lim.max_binding, M, V)
    products = arch.products(cfg, M, grad) | {(chunk, V, E)}
    if grad:
        products |= {(chunk, E, V), (V, E, chunk)}
        if kind == "train":  # the norms' weight gradients (adapt and LoRA compute none)
            _, nch = rmsnorm.chunks(lim, M, E)
            scratch += _buf(4 * nch * E)
        n_partials = sum(cdiv(_numel(shapes[n]), 2048) + 1 for n in _trainable(cfg, kind, list(shapes)))
        n_partials += sum(cdiv(n, 2048) + 1 for n in a_sizes) if kind == "lora" else 0
        scratch += _buf(4 * max(1024, 1 << (n_partials - 1).bit_length()))
    scratch += _splitk_scratch(lim, products, mixed) + _buf(4 * 1024)
    # evaluation: top-1/top-5 hits per row, a batch's window sums, the sums of the batches
    # read back at a time (trainer.eval_group: at most EVAL_READ_WINDOWS windows')
    if plan.eval_passes:
        scratch += (_buf(4 * 2 * M) + _buf(4 * 3 * B)
                    + sum(_buf(4 * 3 * B * eval_group(B, n)) for n in sorted(set(int(n) for n in plan.eval_passes))))
    if grad:  # the trainer's trace (loss and grad norm per step) and step loss
        scratch += _buf(4 * 2 * max(1, int(plan.trace_steps))) + _buf(4)
    return scratch


def _units(plan: MemoryPlan, cfg, sequence: str) -> None:
    """The units of work that must each fit one binding: the shell's and the layers'."""
    B, L = plan.batch_size, plan.seq_len
    E, V = cfg.hidden_size, cfg.vocab_size
    grad = plan.kind != "eval"
    plan.units.append((f"one row of the embedding table ({E} values)", 4 * E, False, "tensor"))
    plan.units.append((f"one row of logits ({V} values)", 4 * V, False, "tensor"))
    plan.units += models.of(cfg).plan_units(cfg, B, L, grad, sequence)
    if grad:
        plan.units.append((f"the embedding's scatter plan for batch {B} x {L}", 4 * (2 + 3 * B * L), True, "tensor"))


def _check(plan: MemoryPlan, lim: Limits) -> None:
    slack = lim.storage_align - 4
    shape = f"batch {plan.batch_size} x {plan.seq_len}"
    for what, nbytes, grows, limit_kind in plan.units:
        limit = lim.max_binding if limit_kind == "tensor" else lim.adapter_max_binding
        if nbytes > limit - slack:
            plan.problems.append((binding_refusal(what, nbytes, limit, slack), grows))
    for what, nbytes, grows in plan.buffers:
        if grows and nbytes > lim.max_buffer:  # (a weight too large: store_layout said so)
            plan.problems.append((f"{what} for {shape} needs {fmt_bytes(nbytes)} in one GPU buffer but the "
                                  f"adapter's largest buffer is {fmt_bytes(lim.max_buffer)}", grows))
    if lim.memory is not None and plan.total > lim.memory:
        avail = f"{fmt_bytes(lim.memory)} is available ({lim.memory_source})"
        if plan.fixed > lim.memory:
            parts = ", ".join(f"{k} {fmt_bytes(plan.parts[k])}" for k in ("parameters", "gradients", "moments")
                              if plan.parts[k])
            plan.problems.append((f"{plan.kind} needs {fmt_bytes(plan.fixed)} for the weights alone ({parts}) "
                                  f"but {avail}", False))
        else:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.parts.items() if v)
            plan.problems.append((f"{plan.kind} of {shape} needs {fmt_bytes(plan.total)} ({parts}) but {avail}",
                                  True))


def advice(cfg, plan: MemoryPlan, lim: Limits) -> str:
    """The flag that would make `plan` pass, or a sentence saying that none can."""
    B, L = plan.batch_size, plan.seq_len
    none = "no --batch-size or --seq-len can help on this adapter"
    if any(not grows for _, grows in plan.problems):
        return none

    def ok(b, n):  # the same text in windows of b x n: as many tokens per evaluation pass
        passes = tuple(cdiv(k * B * L, b * n) for k in plan.eval_passes)
        return estimate(cfg, b, n, plan.kind, lim, passes, plan.trace_steps, mixed=plan.mixed).ok

    b = largest(lambda b: ok(b, L), B - 1)  # the largest that passes, or 0
    if b:
        return f"use --batch-size {b}" + (" or less" if b > 1 else "")
    n = largest(lambda n: ok(1, n), L - 1)
    if n:
        return f"use --seq-len {n} or less" + (" with --batch-size 1" if B > 1 else "")
    return none


def check_run(rt, cfg, batch_size: int, seq_len: int, kind: str,
              eval_passes: tuple | None = None, trace_steps: int = 1, adapter: tuple | None = None,
              precision: str = "fp32") -> MemoryPlan:
    """Plan a run on `rt`'s adapter before anything is uploaded; MemengineError (exit 2) with
    one line naming the figure and the flag that would help when it cannot work."""
    lim = Limits.of(rt)
    plan = estimate(cfg, batch_size, seq_len, kind, lim, eval_passes, trace_steps, adapter=adapter,
                    mixed=precision == "mixed")
    if not plan.ok:
        raise MemengineError(f"{plan.problems[0][0]}; {advice(cfg, plan, lim)}")
    return plan


def min_binding(cfg, batch_size: int, seq_len: int, kind: str = "train") -> int:
    """The smallest binding limit a run passes with (tests force it so every tensor splits)."""
    lim = Limits(2**62, 2**62, 256, 2**62)
    need = max(b for _, b, _, k in estimate(cfg, batch_size, seq_len, kind, lim).units if k == "tensor")
    return need + 256


PLAN_ROWS = ("parameters", "gradients", "moments", "activations", "logits chunk", "scratch")


REPORT_KINDS = KINDS + ("lora",)


def report(cfg, batch_size: int, seq_len: int, lim: Limits, lora: tuple | None = None, mixed: bool = False) -> dict:
    """The plans of eval, train and adapt for one shape (what `memengine info` shows), and of
    training a LoRA adapter when `lora` = (its rank, its `lora.plan_sizes`) is given;
    `mixed`: under --precision mixed."""
    out = {"batch_size": int(batch_size), "seq_len": int(seq_len), "precision": "mixed" if mixed else "fp32",
           "limits": lim.to_dict()}
    kinds = KINDS
    if lora is not None:
        out["lora_rank"] = int(lora[0])
        kinds = REPORT_KINDS
    for kind in kinds:
        p = estimate(cfg, batch_size, seq_len, kind, lim, adapter=lora[1] if kind == "lora" else None, mixed=mixed)
        d = p.to_dict()
        d["advice"] = None if p.ok else advice(cfg, p, lim)
        out[kind] = d
    return out


def report_rows(rep: dict) -> list:
    """Rows (item, eval, train, adapt, lora) of a `report` for a table."""
    kinds = [k for k in REPORT_KINDS if k in rep]
    rows = [(k, *(fmt_bytes(rep[kind]["bytes"][k]) for kind in kinds)) for k in PLAN_ROWS]
    rows.append(("total", *(fmt_bytes(rep[kind]["total_bytes"]) for kind in kinds)))
    rows.append(("fits", *("yes" if rep[kind]["ok"] else "no" for kind in kinds)))
    return rows
