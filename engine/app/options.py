"""The options of each run kind (info, eval, train, adapt, generate): one dataclass each, the only place
that says an option's default, help text, whether a --config file may set it, and what
values it accepts.  The command line builds its flags from these fields (cli/params.py),
so nothing here is repeated there.

An options object is checked once, when it is made (`__post_init__`: each field's check,
then the checks between fields), and is frozen from then on: nothing writes into it (a
changed copy is `dataclasses.replace`).  What a run needs given (CKPT, --data, --output,
--prompt) is checked when the run starts (`check_inputs`), so that a library user may
build partial options for the parts (the trainer, `generate`).

Precedence when a command resolves its options (`resolve_options`): a flag given on the command
line (or its environment variable) > the --config file > the resumed run's options
(--resume) > the default here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from memengine.engine.backend import BACKENDS, ENV_BACKEND
from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import read_config_data
from memengine.engine.io.shards import DEFAULT_MAX_SHARD_SIZE, parse_size
from memengine.engine import models

# tokens one step (or one evaluation batch) may hold: its rows are 32-bit indices
MAX_ROWS = 2**31 - 1
# every number option reaches float32 kernels or counts steps: larger is no setting at all
F32_MAX = float(3.4028234663852886e38)
MAX_COUNT = 2**64 - 1   # (a 64-bit seed is the largest integer an option holds)

# the largest LoRA alpha taken: alpha / r scales an adapter's update, and far beyond any
# trained adapter's a float32 product overflows (1e30: a NaN loss, 1e308: an OverflowError)
MAX_LORA_ALPHA = 1e6

# help panels of --help
DATA = "Data"
TRAINING = "Training"
SCHEDULE = "Schedule"
EVALUATION = "Evaluation"
CHECKPOINTS = "Checkpoints"
LORA = "LoRA"
RUNTIME = "Runtime"
OUTPUT = "Output"
GENERATION = "Generation"


@dataclass(frozen=True)
class Spec:
    """What the command line and --config need to know about one option."""

    help: str
    flags: tuple = ()              # default: ("--" + name with dashes,)
    panel: str = TRAINING
    check: Optional[tuple] = None  # (predicate(value) -> bool, "why it is wrong")
    config: bool = True            # a --config file may set it
    restore: bool = True           # --resume takes it from the resumed run
    argument: bool = False         # positional (CKPT)
    metavar: Optional[str] = None
    envvar: Optional[str] = None
    show_default: Any = True
    path: bool = False             # a local path: records keep only its public form (resolve.public_path)


def opt(default: Any = MISSING, *, factory: Callable | None = None, **spec) -> Any:
    md = {"spec": Spec(**spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


def redefault(cls, name: str, default: Any) -> Any:
    """The same option as `cls.name` with another default (adapt's epochs, max delta)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=default, metadata=f.metadata)


def spec_of(f: dataclasses.Field) -> Spec:
    return f.metadata["spec"]


def flag_of(cls, name: str) -> str:
    """The flag a person types for field `name` (its first long form)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    s = spec_of(f)
    if s.argument:
        return s.metavar or name.upper()
    return (s.flags[0] if s.flags else "--" + name.replace("_", "-")).split("/")[0]


def given(cls, name: str, value: Any) -> str:
    """How a person would have typed `value` for option `name`: "--lr 0.1", "--no-shuffle"."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    s = spec_of(f)
    if isinstance(value, bool):
        pair = (s.flags[0] if s.flags else "--" + name.replace("_", "-")).split("/")
        return pair[0] if value or len(pair) == 1 else pair[1]
    shown = " ".join(map(str, value)) if isinstance(value, list) else value
    return f"{flag_of(cls, name)} {shown}"


# ----------------------------------------------------------------------- checks
def at_least(n):
    return (lambda v: v is None or v >= n, f"must be at least {n}")


def positive():
    return (lambda v: v > 0, "must be positive")


def not_negative():
    return (lambda v: v >= 0, "must not be negative")


def in_unit(closed_right: bool = False):
    if closed_right:
        return (lambda v: 0 <= v <= 1, "must be in [0, 1]")
    return (lambda v: 0 <= v < 1, "must be in [0, 1)")


def one_of(*choices):
    return (lambda v: v in choices, "must be one of " + ", ".join(choices))


def _finite(v) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


# ----------------------------------------------------------------------- base
@dataclass(frozen=True)
class Options:
    """Shared behaviour: validation, conversion of --config values, a JSON record."""

    KIND: ClassVar[str] = ""
    CONFIG_FILE: ClassVar[bool] = True  # the command takes --config
    NOT_OPTIONS: ClassVar[tuple] = ()  # inherited fields this kind does not take (no flag, no --config key)

    # the --config file the options were read from (`resolve_options`), an input of the run; not an option
    config_file: Optional[Path] = field(default=None, kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_values()

    @classmethod
    def option_fields(cls) -> list:
        return [f for f in dataclasses.fields(cls) if "spec" in f.metadata and f.name not in cls.NOT_OPTIONS]

    @classmethod
    def types(cls) -> dict:
        return typing.get_type_hints(cls)

    @classmethod
    def help_values(cls) -> dict:
        """Values the help texts name ({epochs} for the kind's default epochs)."""
        return {}

    def bad(self, name: str, why: str) -> MemengineError:
        return MemengineError(f"{given(type(self), name, getattr(self, name))}: {why}")

    def _check_values(self) -> None:
        """Every field's own check, then the checks between fields; one line naming the flag
        (at construction: the only place options are validated)."""
        for f in self.option_fields():
            v = getattr(self, f.name)
            if not _finite(v):
                raise self.bad(f.name, "must be a finite number")
            if isinstance(v, float) and abs(v) > F32_MAX:
                raise self.bad(f.name, f"must be at most {F32_MAX:.4g} in size (the GPU computes in float32)")
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT:
                raise self.bad(f.name, "must be below 2^64")
            check = spec_of(f).check
            if check is not None and v is not None and not check[0](v):
                raise self.bad(f.name, check[1])
        batch, seq = getattr(self, "batch_size", None), getattr(self, "seq_len", None)
        if isinstance(batch, int) and isinstance(seq, int) and batch * seq > MAX_ROWS:
            raise self.bad("batch_size", f"x --seq-len {seq} must be at most {MAX_ROWS:,} tokens a step (token rows "
                                         "are 32-bit indices)")
        self.check_together()

    def check_together(self) -> None:
        """Checks between fields (their values)."""

    def check_inputs(self) -> None:
        """What a run of this kind needs given (CKPT, --data, ...): checked when the run starts."""

    def validate(self) -> "Options":
        """For a library user about to hand the options to a run: the values were checked when
        they were made; this checks that what the run needs is given.  Returns self."""
        self.check_inputs()
        return self

    def to_dict(self, public: bool = False) -> dict:
        """The options as JSON values; `public`: local paths as outputs may hold them (as
        given when relative, else the base name: no absolute local path in an output)."""
        from memengine.engine.io.resolve import public_path

        out = {}
        for f in self.option_fields():
            v = getattr(self, f.name)
            v = str(v) if isinstance(v, Path) else (list(v) if isinstance(v, list) else v)
            if public and spec_of(f).path and v is not None:
                v = [public_path(x) for x in v] if isinstance(v, list) else public_path(v)
            out[f.name] = v
        return out


# ----------------------------------------------------------------------- shared fields
MISSING_CKPT = "missing argument CKPT (a checkpoint directory or .safetensors file)"
MISSING_DATA = "--data is required (a file, several files, or - for stdin)"

CKPT_HELP = ("Checkpoint: a directory (config.json + model.safetensors or transformers' shards), a .safetensors "
             "file, a model.safetensors.index.json, or a Hugging Face model id (from the local cache, else "
             "downloaded; HF_HUB_OFFLINE=1 forbids downloads); or a PEFT LoRA adapter directory "
             "(adapter_config.json), applied to its base.")


def _ckpt(help_extra: str = "") -> Any:
    return opt(None, argument=True, metavar="CKPT", config=False, restore=False, show_default=False, path=True,
               help=CKPT_HELP + help_extra)


def _revision() -> Any:
    return opt(None, panel=RUNTIME, metavar="REV", restore=False, show_default=False,
               help="Branch, tag or commit of a model id CKPT (default: main).")


def _model_type() -> Any:
    return opt(None, panel=RUNTIME, metavar="mamba|falcon_mamba", restore=False, show_default=False,
               check=(lambda v: v is None or v in models.model_types(),
                      "must be a registered model type (mamba, falcon_mamba, or one MEMENGINE_MODELS adds)"),
               help="Model type of a checkpoint whose config does not state one (a bare .safetensors): "
                    "mamba (assumed) or falcon_mamba.")


def _data(help_extra: str = "") -> Any:
    return opt(factory=list, flags=("--data", "-d"), panel=DATA, show_default=False, metavar="PATH", path=True,
               help="UTF-8 text, .jsonl (each line {{\"text\"}}, {{\"prompt\", \"completion\"}} or "
                    "{{\"messages\"}}, the last rendered with the tokenizer's chat template), a directory of "
                    "train.jsonl / valid.jsonl / test.jsonl, or - for stdin (repeatable; documents are "
                    "separated by the tokenizer's end-of-text token; tokenized once into a token file in "
                    "the cache, MEMENGINE_CACHE_DIR)." + help_extra)


def _prompt_loss(flag: str, what: str) -> Any:
    return opt(False, flags=(flag,), panel=DATA,
               help=what + " the prompt's tokens too: of {{\"prompt\", \"completion\"}} records (default: the "
                    "completion only) and the non-assistant turns of {{\"messages\"}} records (default: the "
                    "assistant's only).")


def _seq_len(default: int) -> Any:
    return opt(default, panel=DATA, check=at_least(1), help="Tokens per window.")


def _batch_size(default: int) -> Any:
    return opt(default, panel=DATA, check=at_least(1), help="Windows per step.")


def _base() -> Any:
    return opt(None, panel=RUNTIME, metavar="BASE", restore=False, show_default=False, path=True,
               help="The base model of a LoRA adapter given as CKPT (or resumed): a path or a model id "
                    "(default: the adapter's base_model_name_or_path).")


def _targets(v: Optional[str]) -> bool:
    from memengine.engine.lora import parse_targets

    try:
        parse_targets(v)
    except ValueError as e:
        raise MemengineError(f"--lora-targets {v}: {e}") from None
    return True


def _device() -> Any:
    return opt(None, panel=RUNTIME, envvar="MEMENGINE_DEVICE", restore=False,
               help="WebGPU adapter: auto, gpu, cpu, or a substring of the adapter's name.")


def _precision(help: str) -> Any:
    return opt("fp32", panel=RUNTIME, check=one_of("fp32", "mixed"), metavar="fp32|mixed", help=help)


def _backend() -> Any:
    return opt(None, panel=RUNTIME, envvar=ENV_BACKEND, restore=False, metavar="|".join(BACKENDS),
               show_default="auto", check=one_of(*BACKENDS),
               help="WebGPU implementation: auto (wgpu-native; Dawn for --precision mixed where wgpudawn "
                    "is installed and the adapter has f16 subgroup matrices), wgpu (wgpu-native) or dawn "
                    "(Dawn: pip install 'memengine[dawn]').")


def _tokenizer() -> Any:
    return opt(None, panel=RUNTIME, restore=False, path=True,
               help="A tokenizer.json (or its directory) to use instead of the one beside the checkpoint; "
                    "'bytes' for the built-in byte-level tokenizer (the default when there is none).")


# ----------------------------------------------------------------------- info
@dataclass(frozen=True)
class InfoOptions(Options):
    """`memengine info`: what a checkpoint holds, the adapter, and the memory plan of eval,
    train and adapt at --batch-size x --seq-len (engine/plan.py)."""

    KIND: ClassVar[str] = "info"
    CONFIG_FILE: ClassVar[bool] = False

    ckpt: Optional[str] = _ckpt()
    seq_len: int = _seq_len(512)
    batch_size: int = _batch_size(1)
    revision: Optional[str] = _revision()
    model_type: Optional[str] = _model_type()
    device: Optional[str] = _device()
    backend: Optional[str] = _backend()
    precision: str = _precision("The plan of runs at this --precision (mixed: with the f16 copies of the "
                                "parameters and activations and their scratch).")

    def check_inputs(self) -> None:
        if self.ckpt is None:
            raise MemengineError(MISSING_CKPT)


# ----------------------------------------------------------------------- eval
@dataclass(frozen=True)
class EvalOptions(Options):
    KIND: ClassVar[str] = "eval"

    ckpt: Optional[str] = _ckpt()
    data: list = _data()
    seq_len: int = _seq_len(512)
    batch_size: int = _batch_size(1)
    prompt_loss: bool = _prompt_loss("--score-prompt", "Score")
    compare: Optional[str] = opt(None, panel=EVALUATION, metavar="B", path=True,
                                 help="A second checkpoint (a path or a model id): evaluate both on the same "
                                      "data and report each and the difference (B minus CKPT).")
    revision: Optional[str] = _revision()
    model_type: Optional[str] = _model_type()
    base: Optional[str] = _base()
    device: Optional[str] = _device()
    backend: Optional[str] = _backend()
    tokenizer: Optional[str] = _tokenizer()

    def check_inputs(self) -> None:
        if self.ckpt is None:
            raise MemengineError(MISSING_CKPT)
        if not self.data:
            raise MemengineError(MISSING_DATA)


# ----------------------------------------------------------------------- train
@dataclass(frozen=True)
class TrainOptions(Options):
    """Full fine-tuning (`memengine train`)."""

    KIND: ClassVar[str] = "train"
    DEFAULT_EPOCHS: ClassVar[int] = 5
    WSLA: ClassVar[bool] = False  # adapt trains each layer's x_proj only

    ckpt: Optional[str] = _ckpt(" Not needed with --resume.")
    data: list = _data(" With --resume: the resumed run's files unless given.")
    output: Optional[Path] = opt(None, flags=("--output", "-o"), panel=OUTPUT, restore=False, show_default=False,
                                 metavar="OUT", path=True,
                                 help="Output checkpoint directory (with --resume: the resumed run's, "
                                      "so training continues in place).")
    epochs: Optional[int] = opt(None, check=at_least(1), show_default=False,
                                help="Passes over the data (default {epochs}; with only --max-steps, as many as "
                                     "the steps need; with both, whichever ends first).")
    max_steps: Optional[int] = opt(None, check=at_least(1), show_default=False,
                                   help="Stop after this many optimizer steps (counted from the run's start, "
                                        "across resumes).")
    lr: float = opt(1e-4, check=positive(), help="AdamW learning rate (the peak, with a schedule).")
    batch_size: int = _batch_size(1)
    grad_accum: int = opt(1, panel=DATA, check=at_least(1),
                          help="Micro-batches per optimizer step: the step equals one at --batch-size "
                               "B x this, with the memory of B.")
    seq_len: int = _seq_len(512)
    prompt_loss: bool = _prompt_loss("--train-on-prompt", "Train on")
    max_grad_norm: float = opt(1.0, check=not_negative(),
                               help="Clip the global gradient L2 norm to this (0 = off).")
    precision: str = _precision("mixed: f16 matmul operands with f32 accumulation, f32 master weights "
                                "and moments, dynamic loss scaling (skipped steps are reported); needs "
                                "an adapter with shader-f16. Faster than fp32 where the adapter has f16 "
                                "subgroup matrices (tensor cores through the Dawn backend: H100 2.39x), "
                                "slower elsewhere (H200 on wgpu-native 0.74x, lavapipe 0.3x; README).")
    weight_decay: float = opt(0.01, check=not_negative(), help="Decoupled AdamW weight decay.")
    max_delta: float = opt(0.0, check=not_negative(),
                           help="Trust region: no element moves more than this per step (0 = off).")
    beta1: float = opt(0.9, check=in_unit(), help="AdamW beta1.")
    beta2: float = opt(0.999, check=in_unit(), help="AdamW beta2.")
    eps: float = opt(1e-8, check=positive(), help="AdamW epsilon.")
    lr_schedule: str = opt("constant", panel=SCHEDULE, check=one_of("constant", "linear", "cosine"),
                           metavar="constant|linear|cosine",
                           help="Learning-rate schedule after the warmup (transformers' constant, linear "
                                "and cosine schedules with warmup).")
    warmup_steps: int = opt(0, panel=SCHEDULE, check=at_least(0),
                            help="Steps of linear warmup from 0 to --lr.")
    min_lr: float = opt(0.0, panel=SCHEDULE, check=not_negative(),
                        help="Floor of the linear or cosine decay (transformers' cosine-with-min-lr form).")
    seed: int = opt(0, panel=DATA, check=(lambda v: 0 <= v < 2 ** 32, "must be in [0, 2^32)"),
                    help="Seed of the per-epoch window shuffle and of the --val-fraction split.")
    shuffle: bool = opt(True, flags=("--shuffle/--no-shuffle",), panel=DATA,
                        help="Shuffle the windows every epoch (from --seed); --no-shuffle keeps file order.")
    val_data: list = opt(factory=list, panel=EVALUATION, show_default=False, metavar="PATH", path=True,
                         help="Held-out text evaluated during training (repeatable, read like --data).")
    val_fraction: float = opt(0.0, panel=EVALUATION, check=in_unit(),
                              help="Hold out this fraction of the windows of --data instead (split by "
                                   "--seed).")
    eval_every: int = opt(0, panel=EVALUATION, check=at_least(0),
                          help="Evaluate every this many steps (0: only at each epoch's end and after "
                               "the last step).")
    report_to: str = opt("none", panel=OUTPUT, check=one_of("none", "tensorboard"), metavar="none|tensorboard",
                         help="tensorboard: write the step, evaluation and epoch figures as TensorBoard event "
                              "files into OUT/runs/ as they come (tensorboardX, the 'tensorboard' extra; OUT is "
                              "made when the run starts).")
    log_every: int = opt(10, panel=OUTPUT, check=at_least(1),
                         help="Read the loss back every this many steps: a JSON step event, and a "
                              "non-finite loss stops the run within this many steps.")
    save_every: int = opt(0, panel=CHECKPOINTS, check=at_least(0),
                          help="Write OUT/checkpoints/step-K every this many steps and after the last "
                               "(0 = off).")
    save_every_minutes: float = opt(30.0, panel=CHECKPOINTS, check=(lambda v: 0 <= v <= 1e6, "must be in [0, 1e6]"),
                                    metavar="MIN",
                                    help="Also write a checkpoint after every this many minutes of training "
                                         "(0 = off), so that a long run killed without warning keeps its work. "
                                         "Ctrl-C and SIGTERM write one too, after the step in flight.")
    keep_last: int = opt(0, panel=CHECKPOINTS, check=at_least(0),
                         help="Keep only the newest this many checkpoints (0 = all; the best is kept "
                              "too with --keep-best).")
    keep_best: bool = opt(False, panel=CHECKPOINTS,
                          help="Make the checkpoint with the lowest validation loss OUT's model.")
    resume: Optional[Path] = opt(None, panel=CHECKPOINTS, restore=False, metavar="DIR", path=True,
                                 help="Continue a run from a step directory, or from an OUT (its latest "
                                      "step): same weights, optimizer, data position and schedule.")
    max_shard_size: str = opt(DEFAULT_MAX_SHARD_SIZE, panel=OUTPUT, metavar="SIZE",
                              help="Write the weights as shards (model-00001-of-0000N.safetensors + "
                                   "model.safetensors.index.json) when they exceed this size: 5GB, 500MB or a "
                                   "number of bytes, as transformers' save_pretrained.")
    lora_rank: Optional[int] = opt(None, panel=LORA, check=at_least(1), show_default=False, metavar="R",
                                   help="Train a LoRA adapter of rank R instead of the weights (the base stays "
                                        "frozen): OUT is a PEFT adapter directory.")
    lora_alpha: Optional[float] = opt(None, panel=LORA, check=(lambda v: 0 < v <= MAX_LORA_ALPHA,
                                                               f"must be in (0, {MAX_LORA_ALPHA:g}]"),
                                      show_default=False, metavar="A",
                                      help="LoRA scaling numerator: the update is A/R x B A (default: R, a scale "
                                           "of 1).")
    lora_dropout: Optional[float] = opt(None, panel=LORA, check=in_unit(), show_default=False, metavar="P",
                                        help="Dropout on the input of lora_A while training, its mask drawn from "
                                             "--seed (default 0, or the --lora-from adapter's).")
    lora_targets: Optional[str] = opt(None, panel=LORA, check=(_targets, ""), show_default=False,
                                      metavar="LAYERS",
                                      help="Comma-separated mixer layers to adapt: in_proj, x_proj (default both).")
    lora_from: Optional[str] = opt(None, panel=LORA, restore=False, show_default=False, metavar="ADAPTER",
                                   path=True,
                                   help="Continue training this PEFT adapter on CKPT (its rank, alpha and "
                                        "targets; the moments in optimizer.safetensors beside it when present).")
    revision: Optional[str] = _revision()
    model_type: Optional[str] = _model_type()
    base: Optional[str] = _base()
    device: Optional[str] = _device()
    backend: Optional[str] = _backend()
    nproc_per_node: int = opt(1, panel=RUNTIME, check=at_least(1), restore=False, metavar="N",
                              help="Train data-parallel on N ranks of this host (torch.distributed, gloo; "
                                   "needs torch, the distributed extra): each rank takes the GPU of its local rank "
                                   "and --batch-size windows, so a step takes --batch-size x N (x --grad-accum) "
                                   "windows, the step of a one-process run at that batch.")
    shard_moments: bool = opt(False, panel=RUNTIME,
                              help="With several ranks: each keeps the AdamW moments of its share of the "
                                   "tensors only and steps those (ZeRO stage 1), the updated weights then "
                                   "exchanged; the checkpoints hold all moments, as without it.")
    tokenizer: Optional[str] = _tokenizer()
    force: bool = opt(False, flags=("--force", "-f"), panel=OUTPUT, config=False, restore=False,
                      help="Replace OUT if it exists and is not empty.")
    dry_run: bool = opt(False, panel=OUTPUT, config=False, restore=False,
                        help="Check everything and show what the run would do (the options, the data, the steps, "
                             "the checkpoints, the memory plan), then exit: nothing is trained or written.")

    @classmethod
    def help_values(cls) -> dict:
        return {"epochs": cls.DEFAULT_EPOCHS}

    @property
    def lora(self) -> bool:
        """A LoRA run (--lora-rank or --lora-from given)."""
        return self.lora_rank is not None or self.lora_from is not None

    @property
    def epoch_limit(self) -> Optional[int]:
        """Epochs to run: --epochs, else the default unless only --max-steps is given."""
        if self.epochs is not None:
            return self.epochs
        return None if self.max_steps is not None else self.DEFAULT_EPOCHS

    def check_inputs(self) -> None:
        if self.ckpt is None and self.resume is None:
            raise MemengineError(MISSING_CKPT)
        if self.output is None and self.resume is None:
            raise MemengineError("--output is required (the directory to write the model to)")
        if not self.data:
            raise MemengineError(MISSING_DATA)

    @functools.cached_property
    def max_shard_bytes(self) -> int:
        """--max-shard-size in bytes: parsed once, by the check below (cached; not a field)."""
        return parse_size(self.max_shard_size)

    def check_together(self) -> None:
        _ = self.max_shard_bytes  # a bad --max-shard-size fails here (the bytes are kept)
        if self.val_data and self.val_fraction > 0:
            raise self.bad("val_fraction", "give --val-data or --val-fraction, not both")
        if self.min_lr and self.lr_schedule == "constant":
            raise self.bad("min_lr", "needs --lr-schedule linear or cosine")
        if self.min_lr > self.lr:
            raise self.bad("min_lr", f"must not exceed --lr {self.lr:g}")
        if self.eval_every and not (self.val_data or self.val_fraction > 0):
            raise self.bad("eval_every", "needs --val-data or --val-fraction")
        if self.keep_best and not (self.val_data or self.val_fraction > 0):
            raise self.bad("keep_best", "needs --val-data or --val-fraction (the best is by validation loss)")
        if self.keep_best and not self.save_every:
            raise self.bad("keep_best", "needs --save-every (it picks among the periodic checkpoints)")
        if self.keep_last and not self.save_every:
            raise self.bad("keep_last", "needs --save-every")
        if not self.lora:
            for name in ("lora_alpha", "lora_dropout", "lora_targets"):
                if getattr(self, name) is not None:
                    raise self.bad(name, "needs --lora-rank (or --lora-from)")


@dataclass(frozen=True)
class AdaptOptions(TrainOptions):
    """WSLA (`memengine adapt`): each layer's x_proj only, trust region, rollback."""

    KIND: ClassVar[str] = "adapt"
    DEFAULT_EPOCHS: ClassVar[int] = 3
    WSLA: ClassVar[bool] = True

    max_delta: float = redefault(TrainOptions, "max_delta", 0.05)
    tolerance: float = opt(1.25, check=positive(),
                           help="Roll back when perplexity after > before x this.")
    rollback: bool = opt(True, flags=("--rollback/--no-rollback",),
                         help="Restore the input weights and write nothing when perplexity regressed "
                              "(--no-rollback keeps and writes the result anyway).")

    # train's LoRA options: adapt trains x_proj (an adapter given as CKPT is applied, frozen)
    NOT_OPTIONS: ClassVar[tuple] = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_from")


# ----------------------------------------------------------------------- generate
@dataclass(frozen=True)
class SamplingOptions(Options):
    """How a prompt is continued: the library's `generate` (engine/generate.py) takes these;
    `memengine generate` adds its inputs (GenerateOptions)."""

    KIND: ClassVar[str] = "sample"

    max_new_tokens: int = opt(64, flags=("--max-new-tokens", "-n"), panel=GENERATION, check=at_least(1),
                              help="Generate at most this many tokens.")
    temperature: float = opt(0.8, flags=("--temperature", "-t"), panel=GENERATION, check=not_negative(),
                             help="Sampling temperature; 0 is greedy (always the most likely token).")
    top_k: int = opt(0, panel=GENERATION, check=at_least(0),
                     help="Sample only among the K most likely tokens (0 = all).")
    top_p: float = opt(1.0, panel=GENERATION, check=(lambda v: 0 < v <= 1, "must be in (0, 1]; 1 keeps every token"),
                       help="Sample only among the most likely tokens whose probabilities add up to P (1 = all).")
    seed: int = opt(0, panel=GENERATION, check=(lambda v: 0 <= v < 2 ** 64, "must be in [0, 2^64)"),
                    help="Random seed of the sampler: the same seed gives the same text on the same adapter.")
    stop: list = opt(factory=list, panel=GENERATION, metavar="TEXT", show_default=False,
                     check=(lambda v: all(isinstance(s, str) and s for s in v), "must be a non-empty string"),
                     help="Stop when the text contains this string (not included in the output; repeatable).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerateOptions(SamplingOptions):
    """`memengine generate`: a checkpoint, a prompt, and how to continue it."""

    KIND: ClassVar[str] = "generate"

    ckpt: Optional[str] = _ckpt()
    prompt: Optional[str] = opt(None, flags=("--prompt", "-p"), panel=GENERATION, config=False, show_default=False,
                                metavar="TEXT",
                                help="The text to continue, or - to read it from stdin. It is tokenized as eval "
                                     "tokenizes data (no special tokens added).")
    revision: Optional[str] = _revision()
    model_type: Optional[str] = _model_type()
    device: Optional[str] = _device()
    backend: Optional[str] = _backend()
    base: Optional[str] = _base()
    tokenizer: Optional[str] = _tokenizer()

    def check_inputs(self) -> None:
        if self.ckpt is None:
            raise MemengineError(MISSING_CKPT)
        if self.prompt is None:
            raise MemengineError("--prompt is required (the text to continue, or - for stdin)")


# ----------------------------------------------------------------------- --config
def load_option_file(path: Path) -> dict:
    """Read a YAML/JSON mapping of option names (dashes or underscores)."""
    p = Path(path)
    if not p.exists():
        raise MemengineError(f"--config {p}: file not found")
    if not p.is_file():
        raise MemengineError(f"--config {p}: not a regular file (a config is a YAML or JSON file)")
    data = read_config_data(p, "--config file", f"--config {p}", yaml=p.suffix.lower() != ".json")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MemengineError(f"--config {p}: expected a mapping of option names to values")
    out: dict = {}
    for k, v in data.items():
        key = str(k).strip().lstrip("-").replace("-", "_")
        if key in out:
            raise MemengineError(f"--config {p}: option '{key}' is set twice (as '{k}' and another spelling)")
        out[key] = v
    return out


def _convert(hint, val, where: str):
    """A --config (or recorded) value to the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        if val is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
    try:
        if hint is bool:
            if not isinstance(val, bool):
                raise ValueError(f"expected true/false, got {val!r}")
            return val
        if hint is int:
            if isinstance(val, bool) or (isinstance(val, float) and not val.is_integer()) or isinstance(val, str):
                raise ValueError(f"expected an integer, got {val!r}")
            return int(val)
        if hint is float:
            if isinstance(val, bool):
                raise ValueError(f"expected a number, got {val!r}")
            return float(val)
        if hint is Path:
            if not isinstance(val, str):
                raise ValueError(f"expected a path, got {val!r}")
            return Path(val)
        if hint is str:
            if not isinstance(val, (str, int, float)) or isinstance(val, bool):
                raise ValueError(f"expected a string, got {val!r}")
            return str(val)
        if hint is list or origin is list:
            if isinstance(val, str):
                return [val]
            if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
                raise ValueError(f"expected a list of paths, got {val!r}")
            return list(val)
    except (TypeError, ValueError) as e:
        raise MemengineError(f"{where}: {e}") from None
    return val


def config_values(cls, data: dict, source: str) -> dict:
    """The options a --config mapping sets, converted; unknown keys are an error."""
    allowed = {f.name: f for f in cls.option_fields() if spec_of(f).config}
    hints = cls.types()
    out = {}
    for key, val in data.items():
        if key not in allowed:
            raise MemengineError(f"{source}: unknown option '{key}' (known: {', '.join(allowed)})")
        out[key] = _convert(hints[key], val, f"{source}: option '{key}'")
    return out


def _recorded_type_ok(hint, val) -> bool:
    """A value of a trainer state's options is of its field's JSON type exactly (memengine
    wrote it: a string where a number belongs is not converted)."""
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        if val is None:
            return True
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return isinstance(val, bool)
    if hint is int:
        return isinstance(val, int) and not isinstance(val, bool)
    if hint is float:
        return isinstance(val, (int, float)) and not isinstance(val, bool)
    if hint in (str, Path):
        return isinstance(val, str) and val != "" and "\x00" not in val
    if hint is list or typing.get_origin(hint) is list:
        return isinstance(val, list) and all(isinstance(x, str) and x != "" and "\x00" not in x for x in val)
    return True


def restored_values(cls, recorded: dict, complete: bool = False, where: str = "resumed") -> dict:
    """The options of a resumed run that carry over (those with restore=True), each of its
    field's type; `complete`: the record must hold every one of them (a state this version
    wrote)."""
    hints = cls.types()
    out = {}
    for f in cls.option_fields():
        if not spec_of(f).restore:
            continue
        if f.name not in recorded:
            if complete:
                raise MemengineError(f"{where}: the run's option '{f.name}' is missing; the state is incomplete")
            continue
        if not _recorded_type_ok(hints[f.name], recorded[f.name]):
            raise MemengineError(f"{where}: the run's option '{f.name}' is {recorded[f.name]!r}, not a value of "
                                 "that option; the state is not one memengine wrote")
        out[f.name] = _convert(hints[f.name], recorded[f.name], f"resumed option '{f.name}'")
    return out


def resolve_options(cls, explicit: dict, config_file: Optional[Path] = None):
    """Options from flags given explicitly, a --config file, a resumed run, and defaults;
    checked (once: as they are made) and frozen."""
    config = config_values(cls, load_option_file(config_file), f"--config {config_file}") if config_file else {}
    values = {**config, **explicit}
    resumed = {}
    if values.get("resume") is not None:
        from memengine.engine.train.snapshots import recorded_options

        opts, complete, where = recorded_options(Path(values["resume"]), cls.KIND)
        resumed = restored_values(cls, opts, complete, where)
    return cls(**{**resumed, **values}, config_file=None if config_file is None else Path(config_file))
