"""IEEE 754 half-precision (f16) and bfloat16 codecs (used by the safetensors reader and
writer, checkpoints and `memengine quantize`; imports nothing of the engine but errors).

The encoders round to nearest, ties to even; subnormals, signed zeros and infinities
exact; NaN stays NaN (sign and top payload bits kept). bfloat16 works on the bit patterns
with integer numpy; f16 takes numpy's cast and sets the NaNs itself. A finite input that
rounds beyond the target's largest finite value is an *overflow*, reported in a mask so
callers can refuse or saturate.
"""

from __future__ import annotations

import numpy as np
from memengine.engine.errors import MemengineError

F16_MAX = 65504.0
F16_MAX_BITS = 0x7BFF
BF16_MAX_BITS = 0x7F7F  # 3.3895314e38
BF16_MAX = float(np.array([BF16_MAX_BITS << 16], dtype=np.uint32).view(np.float32)[0])


def _bits32(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    return x.view(np.uint32).astype(np.uint64)  # 64-bit lanes: no shift/add overflow


# ------------------------------------------------------------------------------- f16
def f32_to_f16_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (uint16 f16 bit patterns, overflow mask), round-to-nearest-even.

    numpy's cast (IEEE round-to-nearest-even, subnormals included; 80x the integer
    encoder this replaced, which tests/test_quantize.py keeps as the reference), with NaN
    set by this module's rule on every platform: sign and top payload bits kept, never
    infinity (hardware casts may quiet a NaN differently)."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16)
    bits = h.view(np.uint16)
    overflow = np.isinf(h) & np.isfinite(x)
    nan = np.isnan(x)
    if nan.any():
        b = x.view(np.uint32)[nan]
        nb = 0x7C00 | ((b & 0x7FFFFF) >> 13)
        bits[nan] = (np.where(nb == 0x7C00, 0x7C01, nb) | ((b >> 16) & 0x8000)).astype(np.uint16)
    return bits, overflow


def f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    """uint16 f16 bit patterns -> float32, exactly (subnormal = mantissa/1024 * 2^-14)."""
    h = np.asarray(h, dtype=np.uint16).astype(np.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    bits = np.where(exp == 0x1F, 0x7F800000 | (mant << 13), ((exp + 112) << 23) | (mant << 13)).astype(np.uint32)
    out = bits.view(np.float32).copy()
    sub = exp == 0
    out[sub] = (mant[sub].astype(np.float32) / np.float32(1024.0)) * np.float32(2.0**-14)
    return (out.view(np.uint32) | sign.astype(np.uint32)).view(np.float32)


# ------------------------------------------------------------------------------ bf16
def f32_to_bf16_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (uint16 bfloat16 bit patterns, overflow mask), round-to-nearest-even."""
    b = _bits32(x)
    a = b & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    overflow = (a >= 0x7F7F8000) & ~is_nan & ~is_inf  # rounds up to infinity
    out = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    out = np.where(is_nan, (b >> 16) | 0x0040, out)  # quiet NaN
    out = np.where(is_inf, b >> 16, out)
    return (out & 0xFFFF).astype(np.uint16), overflow


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (the upper 16 bits of an f32)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


ENCODERS = {"F16": (f32_to_f16_bits, f16_bits_to_f32, F16_MAX_BITS, F16_MAX),
             "BF16": (f32_to_bf16_bits, bf16_bits_to_f32, BF16_MAX_BITS, BF16_MAX)}


# the one table of dtype names a user may give (--dtype and the library calls)
DTYPE_ALIASES = {"f16": "F16", "fp16": "F16", "float16": "F16", "half": "F16",
                 "bf16": "BF16", "bfloat16": "BF16",
                 "f32": "F32", "fp32": "F32", "float32": "F32", "float": "F32"}


def normalize_dtype(dtype: str, flag: str = "--dtype") -> str:
    """'f16'/'fp16'/'float16'/'half' -> 'F16', 'bf16'/'bfloat16' -> 'BF16', 'f32'/'fp32'/'float32'/'float' -> 'F32'."""
    d = str(dtype).strip().lower()
    if d not in DTYPE_ALIASES:
        names = ", ".join(DTYPE_ALIASES)
        raise MemengineError(f"{flag} {dtype}: unknown dtype (one of {names})")
    return DTYPE_ALIASES[d]


def quantize_target(dtype: str, flag: str = "--dtype") -> str:
    """The 16-bit target of `quantize` ('f16' or 'bf16') for any alias of it."""
    dt = normalize_dtype(dtype, flag)
    if dt not in ("F16", "BF16"):
        raise MemengineError(f"{flag} {dtype}: quantize writes f16 (fp16, float16, half) or bf16 (bfloat16)")
    return dt.lower()


def encode(x: np.ndarray, dtype: str, *, name: str = "tensor", saturate: bool = False) -> np.ndarray:
    """float32 -> uint16 bit patterns of `dtype` ('F16' or 'BF16').

    A finite value beyond the target's range raises MemengineError naming `name`, unless
    `saturate` (then it becomes the largest finite value of that sign)."""
    dt = normalize_dtype(dtype)
    if dt not in ENCODERS:
        raise MemengineError(f"cannot encode to {dt}: only F16 and BF16 are 16-bit targets")
    enc, _, max_bits, max_val = ENCODERS[dt]
    bits, overflow = enc(x)
    if overflow.any():
        if not saturate:
            flat = np.asarray(x, dtype=np.float32).reshape(-1)
            idx = int(np.flatnonzero(overflow.reshape(-1))[0])
            raise MemengineError(
                f"tensor '{name}': value {float(flat[idx]):.6g} at index {idx} is outside the {dt} range "
                f"(largest finite {max_val:.6g}); {int(overflow.sum())} value(s) overflow (use --saturate to clamp)"
            )
        sign = bits & 0x8000
        bits = np.where(overflow, sign | max_bits, bits).astype(np.uint16)
    return bits


def decode(bits: np.ndarray, dtype: str) -> np.ndarray:
    dt = normalize_dtype(dtype)
    return ENCODERS[dt][1](bits)




def overflows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Mask of finite float32 values that round beyond `dtype`'s largest finite value."""
    return ENCODERS[normalize_dtype(dtype)][0](x)[1]
