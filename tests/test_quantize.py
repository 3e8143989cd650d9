"""f16 / bf16 encoders against numpy's astype(float16) and torch's bfloat16 (the oracles)."""

import json
import warnings

import numpy as np
import pytest
import torch
from memengine.engine.app.quantize import quantize_checkpoint
from memengine.engine.errors import MemengineError
from memengine.engine.io.checkpoint import load_checkpoint, save_checkpoint
from memengine.engine.io.codec import bf16_bits_to_f32, encode, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models.mamba1.init import init_weights

RNG = np.random.default_rng(1234)


def _patterns() -> np.ndarray:
    """uint32 bit patterns: random, the f16 range, halfway cases, edges, specials."""
    n = 200_000
    parts = [RNG.integers(0, 2**32, size=n, dtype=np.uint64)]
    # exponents spanning f16 subnormal .. overflow, both signs
    near = RNG.integers(0x32000000, 0x47FFFFFF, size=n, dtype=np.uint64)
    parts.append(near | (RNG.integers(0, 2, size=n, dtype=np.uint64) << 31))
    # exact halfway points for f16 (13 dropped bits = 0x1000) and bf16 (16 dropped bits = 0x8000), +-1
    hw16 = (near & ~np.uint64(0x1FFF)) | 0x1000
    hwbf = (parts[0] & ~np.uint64(0xFFFF)) | 0x8000
    parts += [hw16, hw16 + 1, hw16 - 1, hwbf, hwbf + 1, hwbf - 1]
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF,
                0x00000001, 0x807FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0x38800000, 0x387FFFFF,
                0x38000000, 0x477FEFFF, 0x477FF000, 0x477FE000, 0x477FFFFF, 0x47800000, 0x7F7FFFFF,
                0x7F7F7FFF, 0x7F7F8000, 0x00800000, 0x007FFFFF, 0x3F800000, 0xBF800000]
    parts.append(np.array(specials, dtype=np.uint64))
    return np.concatenate(parts).astype(np.uint32)


def _f16_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The f16 encoder in integer numpy (round-to-nearest-even by hand, on 64-bit lanes):
    the reference for codec.f32_to_f16_bits, which takes numpy's cast."""
    b = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    out = np.zeros(b.shape, dtype=np.uint64)

    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    overflow = (a >= 0x477FF000) & ~is_nan & ~is_inf  # >= 65520 rounds to infinity
    normal = (a >= 0x38800000) & (a < 0x477FF000)  # [2^-14, 65520)
    sub = a < 0x38800000

    # normal: rebias exponent (127 -> 15), round the 13 dropped mantissa bits
    an = a[normal]
    out[normal] = (an - 0x38000000 + 0xFFF + ((an >> 13) & 1)) >> 13

    # subnormal (and zero): value = m * 2^(e-150); unit 2^-24 -> q = m >> (126 - e)
    asub = a[sub]
    e = asub >> 23
    m = (asub & 0x7FFFFF) | np.where(e > 0, 0x800000, 0).astype(np.uint64)
    s = np.minimum(np.where(e > 0, 126 - e.astype(np.int64), 125), 25).astype(np.uint64)
    q = m >> s
    r = m & ((np.uint64(1) << s) - 1)
    half = np.uint64(1) << (s - 1)
    q = q + ((r > half) | ((r == half) & ((q & 1) == 1))).astype(np.uint64)
    out[sub] = q

    out[is_inf | overflow] = 0x7C00
    an = a[is_nan]
    nb = 0x7C00 | ((an & 0x7FFFFF) >> 13)  # NaN keeps its top payload bits (numpy's choice) ...
    out[is_nan] = np.where(nb == 0x7C00, 0x7C01, nb)  # ... and never becomes infinity
    return (out | sign).astype(np.uint16), overflow


def test_f16_encoder_bit_exact_vs_numpy():
    """The encoder equals the integer reference on every pattern (NaNs included), and the
    reference equals numpy's cast on every non-NaN pattern."""
    x = _patterns().view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        npy = x.astype(np.float16).view(np.uint16)
    ref, ref_overflow = _f16_reference(x)
    nan = np.isnan(x)
    mism = np.flatnonzero((ref != npy) & ~nan)
    assert mism.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(ref[i])), hex(int(npy[i]))) for i in mism[:5]]
    bits, overflow = f32_to_f16_bits(x)
    assert bits.dtype == np.uint16 and nan.any()
    mism = np.flatnonzero(bits != ref)
    assert mism.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(bits[i])), hex(int(ref[i]))) for i in mism[:5]]
    # overflow = finite input that rounds to infinity
    assert np.array_equal(overflow, ref_overflow)
    assert np.array_equal(overflow, np.isfinite(x) & np.isinf(npy.view(np.float16)))
    assert overflow.any() and (~overflow).any()


def test_f16_subnormals_and_zero_signs():
    x = np.array([2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14, 2.0**-14 - 2.0**-25, -0.0, 0.0, 3 * 2.0**-26],
                 dtype=np.float32)
    bits, _ = f32_to_f16_bits(x)
    assert bits.tolist() == x.astype(np.float16).view(np.uint16).tolist()
    assert bits[5] == 0x8000 and bits[6] == 0


def test_f16_decoder_exact_all_patterns():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ours = f16_bits_to_f32(h)
    ref = h.view(np.float16).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    sub = h[(h & 0x7C00) == 0]
    mant = (sub & 0x3FF).astype(np.float64)
    sign = np.where(sub & 0x8000, -1.0, 1.0)
    assert np.array_equal(f16_bits_to_f32(sub).astype(np.float64), sign * mant / 1024 * 2.0**-14)


def test_bf16_encoder_bit_exact_vs_torch():
    x = _patterns().view(np.float32)
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    bits, overflow = f32_to_bf16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(bits[~nan], ref[~nan])
    assert np.isnan(bf16_bits_to_f32(bits[nan])).all()  # torch canonicalises NaN; ours stays NaN
    back = torch.from_numpy(ref.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(overflow, np.isfinite(x) & np.isinf(back))


def test_bf16_decoder_exact_all_patterns():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ref = torch.from_numpy(h.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_bits_to_f32(h).view(np.uint32), ref.view(np.uint32))


def test_nan_stays_nan_f16():
    x = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F801FFF], dtype=np.uint32).view(np.float32)
    bits, overflow = f32_to_f16_bits(x)
    assert np.isnan(bits.view(np.float16)).all() and not overflow.any()


def test_overflow_refused_or_saturated():
    x = np.array([1.0, 70000.0, -1e6, 65519.0], dtype=np.float32)
    with pytest.raises(MemengineError, match="w.bad.*outside the F16 range"):
        encode(x, "f16", name="w.bad")
    bits = encode(x, "f16", name="w", saturate=True)
    assert f16_bits_to_f32(bits).tolist() == [1.0, 65504.0, -65504.0, 65504.0]
    big = np.array([3.4e38, -3.4e38, 1.0], dtype=np.float32)
    with pytest.raises(MemengineError, match="BF16"):
        encode(big, "bf16", name="w")
    assert bf16_bits_to_f32(encode(big, "bf16", saturate=True))[:2].tolist() == [3.3895313892515355e38, -3.3895313892515355e38]


def _tiny(tmp_path, **kw):
    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, **kw)
    w = init_weights(cfg, 3)
    src = save_checkpoint(tmp_path / "src", cfg, w)
    (src / "tokenizer.json").write_text("{}")
    return cfg, w, src


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_quantize_checkpoint(tmp_path, dtype):
    cfg, w, src = _tiny(tmp_path)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    rep = quantize_checkpoint(src, tmp_path / "out", dtype=dtype)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # input untouched
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    ck = load_checkpoint(out)
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    for k, v in w.items():
        ref = torch.from_numpy(v).to(tdt).float().numpy()
        assert np.array_equal(ck.tensors[k], ref), k
        assert ck.dtypes[k] == dtype.upper()
    assert rep.n_params == sum(v.size for v in w.values())
    assert rep.bytes_before == 4 * rep.n_params and rep.bytes_after == 2 * rep.n_params
    assert rep.bits_per_weight == 16.0
    errs = {t.name: t.max_abs_error for t in rep.tensors}
    for k, v in w.items():
        assert errs[k] == pytest.approx(float(np.abs(torch.from_numpy(v).to(tdt).double().numpy() - v).max()))
    json.dumps(rep.to_dict())
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16


def test_quantize_overflow_names_tensor(tmp_path):
    cfg, w, src = _tiny(tmp_path)
    w["backbone.layers.0.mixer.D"][3] = 1e5
    src = save_checkpoint(tmp_path / "big", cfg, w)
    with pytest.raises(MemengineError, match="backbone.layers.0.mixer.D"):
        quantize_checkpoint(src, tmp_path / "o1", dtype="f16")
    assert not (tmp_path / "o1" / "model.safetensors").exists()
    rep = quantize_checkpoint(src, tmp_path / "o2", dtype="f16", saturate=True)
    assert rep.saturated == 1
    assert load_checkpoint(tmp_path / "o2").tensors["backbone.layers.0.mixer.D"][3] == 65504.0
    # bf16 holds 1e5 fine
    quantize_checkpoint(src, tmp_path / "o3", dtype="bf16")


def test_quantize_dry_run_and_refusals(tmp_path):
    cfg, w, src = _tiny(tmp_path)
    rep = quantize_checkpoint(src, tmp_path / "dry", dtype="f16", dry_run=True)
    assert rep.bytes_after > 0 and not (tmp_path / "dry").exists()
    with pytest.raises(MemengineError, match="dtype"):
        quantize_checkpoint(src, tmp_path / "x", dtype="int4")
    with pytest.raises(MemengineError, match="input checkpoint"):
        quantize_checkpoint(src, src, dtype="f16")


def test_quantized_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, w, src = _tiny(tmp_path)
    (src / "tokenizer.json").unlink()
    quantize_checkpoint(src, tmp_path / "q", dtype="f16")
    m = transformers.MambaForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    ck = load_checkpoint(tmp_path / "q")
    sd = m.state_dict()
    for k, v in ck.tensors.items():
        assert np.array_equal(sd[k].numpy(), v), k
