"""Our safetensors reader: fuzzed with hypothesis (only MemengineError, never another
exception or a hang) and exact F16/BF16/F64 decoding against numpy / torch / safetensors."""

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memengine.engine.errors import MemengineError
from memengine.engine.io.safetensors_io import BF16Bits, read_header, read_safetensors, write_safetensors

torch = pytest.importorskip("torch")
from safetensors.numpy import save as st_save  # noqa: E402  (reference writer)
from safetensors.torch import load_file as st_load_torch  # noqa: E402

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


def _valid_file_bytes() -> bytes:
    rng = np.random.default_rng(0)
    return st_save({
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float16),
        "c": np.arange(6, dtype=np.int64).reshape(2, 3),
        "d": np.zeros((0, 2), np.float32),
    }, metadata={"format": "pt"})


BASE = _valid_file_bytes()
(HLEN,) = struct.unpack("<Q", BASE[:8])
HEADER = json.loads(BASE[8:8 + HLEN])


def _read(path):
    try:
        t, d, m = read_safetensors(path)
    except MemengineError as e:
        msg = str(e)
        assert str(path) in msg and "\n" not in msg
        return None
    assert set(t) == set(d)
    return t


def _build(header: dict, data: bytes, pad: bool = True) -> bytes:
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def test_reader_matches_reference_on_valid_file(tmp_path):
    p = tmp_path / "v.safetensors"
    p.write_bytes(BASE)
    t, d, m = read_safetensors(p)
    ref = st_load_torch(str(p))
    assert m == {"format": "pt"}
    assert d == {"a": "F32", "b": "F16", "c": "I64", "d": "F32"}
    for k, v in ref.items():
        want = v.float().numpy() if v.is_floating_point() else v.numpy()
        assert t[k].shape == want.shape and np.array_equal(t[k], want), k
    assert t["a"].dtype == np.float32 and t["b"].dtype == np.float32


@FUZZ
@given(st.data())
def test_fuzz_byte_mutations(tmp_path, data):
    raw = bytearray(BASE)
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del raw[i:]
        elif kind == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[i:i + data.draw(st.integers(1, 8))]
    p = tmp_path / "m.safetensors"
    p.write_bytes(bytes(raw))
    _read(p)


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 2**64 - 1))
def test_fuzz_header_length_and_garbage(tmp_path, body, n):
    p = tmp_path / "g.safetensors"
    p.write_bytes(struct.pack("<Q", n) + body)
    _read(p)
    p.write_bytes(body[:7])
    assert _read(p) is None


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=6))
json_any = st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
                        max_leaves=10)


@FUZZ
@given(st.data())
def test_fuzz_structured_header(tmp_path, data):
    header = json.loads(json.dumps(HEADER))
    name = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "extra", "meta", "drop"]))
    if field == "dtype":
        header[name]["dtype"] = data.draw(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL",
                                                           "F8_E4M3", "Q4", "f32", ""]) | json_any)
    elif field == "shape":
        header[name]["shape"] = data.draw(st.lists(st.integers(-3, 2**40), max_size=5) | json_any)
    elif field == "data_offsets":
        header[name]["data_offsets"] = data.draw(st.lists(st.integers(-5, 400), min_size=0, max_size=3) | json_any)
    elif field == "entry":
        header[name] = data.draw(json_any)
    elif field == "extra":
        header[name][data.draw(st.text(max_size=4))] = data.draw(json_any)
    elif field == "meta":
        header["__metadata__"] = data.draw(json_any)
    else:
        del header[name]
    p = tmp_path / "s.safetensors"
    p.write_bytes(_build(header, BASE[8 + HLEN:], pad=data.draw(st.booleans())))
    _read(p)


def test_specific_errors_name_file_and_tensor(tmp_path):
    data = BASE[8 + HLEN:]
    p = tmp_path / "e.safetensors"
    cases = []
    h = json.loads(json.dumps(HEADER)); h["a"]["data_offsets"] = [0, 4000]
    cases.append((h, "'a'.*beyond"))
    h = json.loads(json.dumps(HEADER)); h["a"]["shape"] = [3, 5]
    cases.append((h, "'a'.*needs"))
    h = json.loads(json.dumps(HEADER)); h["a"]["dtype"] = "Q4"
    cases.append((h, "'a'.*dtype"))
    h = json.loads(json.dumps(HEADER)); h["b"]["data_offsets"] = [h["a"]["data_offsets"][0] + 4, h["a"]["data_offsets"][0] + 14]
    cases.append((h, "overlap"))
    for header, match in cases:
        p.write_bytes(_build(header, data))
        with pytest.raises(MemengineError, match=match):
            read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 6) + b"{oops}" + data)
    with pytest.raises(MemengineError, match="e.safetensors.*JSON"):
        read_header(p)
    p.write_bytes(b'\x02\x00\x00\x00\x00\x00\x00\x00{"')
    with pytest.raises(MemengineError, match="JSON"):
        read_header(p)
    with pytest.raises(MemengineError, match="not found"):
        read_header(tmp_path / "none.safetensors")
    with pytest.raises(MemengineError, match="directory"):
        read_header(tmp_path)


def test_duplicate_keys_refused(tmp_path):
    h = json.dumps(HEADER)[:-1] + ', "a": ' + json.dumps(HEADER["a"]) + "}"
    p = tmp_path / "d.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h.encode() + BASE[8 + HLEN:])
    with pytest.raises(MemengineError, match="duplicate"):
        read_header(p)


def test_f16_bf16_f64_decode_exact(tmp_path):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every pattern incl. subnormals, inf, nan
    f64 = np.random.default_rng(1).standard_normal(1000) * 10.0 ** np.random.default_rng(2).integers(-40, 40, 1000)
    p = tmp_path / "h.safetensors"
    p.write_bytes(st_save({"h": bits.view(np.float16), "f64": f64}))
    t, d, _ = read_safetensors(p)
    ref_h = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(t["h"].view(np.uint32), ref_h.view(np.uint32))
    with np.errstate(over="ignore"):
        assert np.array_equal(t["f64"], f64.astype(np.float32))
    # bf16: written by torch's safetensors, read by ours
    from safetensors.torch import save_file

    tb = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    save_file({"b": tb}, str(tmp_path / "b.safetensors"))
    t, d, _ = read_safetensors(tmp_path / "b.safetensors")
    assert d["b"] == "BF16"
    assert np.array_equal(t["b"].view(np.uint32), tb.float().numpy().view(np.uint32))
    raw, _, _ = read_safetensors(tmp_path / "b.safetensors", raw=True)
    assert np.array_equal(raw["b"], bits)


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
                       st.tuples(st.sampled_from(["f4", "f2", "bf16", "i8", "u1", "?"]),
                                 st.lists(st.integers(0, 4), max_size=3)), max_size=5),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_writer_roundtrip_vs_reference_reader(tmp_path, spec, meta):
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (dt, shape) in spec.items():
        if dt == "bf16":
            tensors[name] = BF16Bits(rng.integers(0, 2**16, size=shape, dtype=np.uint16))
        else:
            tensors[name] = (rng.standard_normal(shape) * 100).astype(dt)
    p = tmp_path / "w.safetensors"
    write_safetensors(p, tensors, meta or None)
    ref = st_load_torch(str(p))
    assert list(ref) == sorted(tensors) or set(ref) == set(tensors)
    t, d, m = read_safetensors(p)
    assert m == meta
    for k, v in tensors.items():
        if isinstance(v, BF16Bits):
            assert ref[k].dtype == torch.bfloat16
            assert np.array_equal(ref[k].view(torch.int16).numpy().view(np.uint16), v.bits)
        else:
            assert np.array_equal(ref[k].numpy(), v)
            assert t[k].shape == v.shape


# ------------------------------------------------------------------ as strict as the reference
from safetensors import safe_open  # noqa: E402

# what we refuse on purpose though the reference accepts it (documented in read_header)
STRICTER = ("duplicate key", "unexpected key", "unsupported dtype", "dimensions is implausible")


def _reference_accepts(path) -> bool:
    try:
        with safe_open(str(path), "numpy") as f:
            f.keys()
        return True
    except Exception:
        return False


def _ours(path) -> str | None:
    """None when our reader accepts the header, else its one-line message."""
    try:
        read_header(path)
        return None
    except MemengineError as e:
        msg = str(e)
        assert str(path) in msg and "\n" not in msg, msg
        return msg


def _raw(header_text: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header_text)) + header_text + data


F4 = np.arange(4, dtype=np.float32).tobytes()
_A = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
REFERENCE_REFUSES = {
    "bytes after the last tensor": _build({"a": _A}, F4 + b"xx", pad=False),
    "bytes before the first tensor": _build({"a": {**_A, "data_offsets": [4, 20]}}, b"JUNK" + F4, pad=False),
    "a gap between tensors": _build({"a": {**_A, "shape": [2], "data_offsets": [0, 8]},
                                     "b": {**_A, "shape": [1], "data_offsets": [12, 16]}}, F4, pad=False),
    "data and no tensor": _build({}, F4, pad=False),
    "an empty tensor inside another": _build({"a": _A, "z": {**_A, "shape": [0], "data_offsets": [4, 4]}}, F4),
    "overlapping tensors": _build({"a": _A, "b": {**_A, "shape": [2], "data_offsets": [8, 16]}}, F4),
    "a lone surrogate in a name": _raw(b'{"\\ud800": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', F4),
    "a negative zero in a shape": _raw(b'{"a": {"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b""),
    "NaN in a shape": _raw(b'{"a": {"dtype":"F32","shape":[NaN],"data_offsets":[0,16]}}', F4),
    "a float offset": _raw(b'{"a": {"dtype":"F32","shape":[4],"data_offsets":[0,16.0]}}', F4),
    "a header that is a list": _raw(b"[]", b""),
    "a byte-order mark": _raw(b'\xef\xbb\xbf{"a": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', F4),
    "NUL padding": _raw(b'{"a": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}\0\0', F4),
    "invalid UTF-8": _raw(b'{"a\xff": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', F4),
    "nesting 10^5 deep": _raw(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b""),
    "a 5000-digit number": _raw(b'{"a": {"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,16]}}', F4),
    "a shape whose size overflows": _build({"a": {**_A, "shape": [2**62, 2**62]}}, F4),
    "__metadata__ twice": _raw(b'{"__metadata__":{}, "__metadata__":{}}', b""),
    "a header length beyond the limit": struct.pack("<Q", 100_000_001) + b"{}",
}


@pytest.mark.parametrize("case", sorted(REFERENCE_REFUSES))
def test_refused_where_the_reference_refuses(tmp_path, case):
    p = tmp_path / "r.safetensors"
    p.write_bytes(REFERENCE_REFUSES[case])
    assert not _reference_accepts(p), case
    assert _ours(p) is not None, case


def test_the_reference_accepts_what_we_accept(tmp_path):
    # leading/trailing JSON whitespace, an empty tensor at a boundary, no tensors at all
    p = tmp_path / "a.safetensors"
    for raw in (_raw(b' {"a": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}\n  ', F4),
                _build({"a": _A, "z": {**_A, "shape": [0], "data_offsets": [16, 16]}}, F4),
                _build({"__metadata__": {"k": "v"}}, b""), BASE):
        p.write_bytes(raw)
        assert _reference_accepts(p) and _ours(p) is None


_st_layout = st.lists(st.tuples(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F64"]),
                                st.lists(st.integers(0, 3), max_size=3)), min_size=0, max_size=5)


@FUZZ
@given(_st_layout, st.data())
def test_fuzz_layouts_decided_like_the_reference(tmp_path, layout, data):
    """Random tensor layouts, then offsets shifted, tensors dropped from the header, bytes
    added before/between/after: we accept exactly when the reference does."""
    header, off = {}, 0
    for i, (dt, shape) in enumerate(layout):
        n = int(np.prod(shape)) * {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F64": 8}[dt]
        header[f"t{i}"] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    size = off
    for _ in range(data.draw(st.integers(0, 3))):
        kind = data.draw(st.sampled_from(["shift", "end", "drop", "grow", "shrink"]))
        if kind in ("shift", "end", "drop") and not header:
            continue
        if kind == "grow":
            size += data.draw(st.integers(1, 9))
        elif kind == "shrink":
            size = max(0, size - data.draw(st.integers(1, 9)))
        else:
            name = data.draw(st.sampled_from(sorted(header)))
            if kind == "drop":
                del header[name]
            else:
                delta = data.draw(st.integers(-9, 9))
                offs = header[name]["data_offsets"]
                if kind == "shift":
                    offs[0] = max(0, offs[0] + delta)
                offs[1] = max(offs[0], offs[1] + delta)
    p = tmp_path / "l.safetensors"
    p.write_bytes(_build(header, bytes(size), pad=data.draw(st.booleans())))
    ours = _ours(p)
    assert (ours is None) == _reference_accepts(p), ours


@FUZZ
@given(st.data())
def test_fuzz_mutations_refused_where_the_reference_refuses(tmp_path, data):
    raw = bytearray(BASE)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        kind = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if kind == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[i:i + data.draw(st.integers(1, 4))]
        if not raw:
            return
    p = tmp_path / "m.safetensors"
    p.write_bytes(bytes(raw))
    ours, ref = _ours(p), _reference_accepts(p)
    if not ref:
        assert ours is not None
    elif ours is not None:
        assert any(s in ours for s in STRICTER), ours
