"""AdamW (shaders/adamw.wgsl) and GradClipper (shaders/reduce.wgsl) against numpy / torch.

The tests taking `lim` run twice: with the adapter's limits and with the storage-binding
limit forced to 4 KiB, so every tensor is stepped / reduced in ranges (each dispatch is
checked against the forced limit).
"""

import contextlib

import numpy as np
import pytest
from conftest import checked_limits
from memengine.engine.train.optim import AdamW, GradClipper

FORCED_BINDING = 4096


@pytest.fixture(params=["adapter", "forced"])
def lim(request, rt, monkeypatch):
    """The runtime, with the adapter's limits or a forced 4 KiB binding limit."""
    ctx = (contextlib.nullcontext({"dispatches": 0}) if request.param == "adapter"
           else checked_limits(rt, monkeypatch, FORCED_BINDING))
    with ctx as seen:
        yield rt
    if request.param == "forced":
        assert seen["dispatches"] > 0


def _align_elems(rt):
    return int(rt.limits.get("min-storage-buffer-offset-alignment", 256)) // 4


def _flat_views(rt, arrays, pad_value=0.0):
    """Upload arrays as views into ONE flat buffer at aligned, non-zero offsets."""
    al = _align_elems(rt)
    offs, pos = [], al  # first view starts at a non-zero offset
    for a in arrays:
        offs.append(pos)
        pos += -(-a.size // al) * al + al
    flat = np.full(pos, pad_value, np.float32)
    for o, a in zip(offs, arrays):
        flat[o:o + a.size] = a.ravel()
    ft = rt.upload(flat)
    return ft, [ft.view(a.shape, o) for o, a in zip(offs, arrays)]


def _step(rt, opt, params, grads, clip=None):
    rec = rt.recorder()
    opt.record_step(rec, params, grads, clip)
    rec.submit()


class RefAdamW:
    """numpy float64 reference, moments keyed by name, global t, SPEC section 4."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.01, max_delta=0.0):
        self.lr, self.eps, self.wd, self.max_delta = lr, eps, wd, max_delta
        # the uniform block carries f32 betas: the reference uses the same rounded values
        self.b1, self.b2 = (float(np.float32(b)) for b in betas)
        self.m, self.v, self.t = {}, {}, 0

    def step(self, params, grads, clip=1.0):
        self.t += 1
        b1, b2, t = self.b1, self.b2, self.t
        out = {}
        with np.errstate(all="ignore"):
            for name, p in params.items():
                g = grads[name].astype(np.float64) * clip
                m = self.m.get(name, np.zeros(p.shape))
                v = self.v.get(name, np.zeros(p.shape))
                m1 = b1 * m + (1 - b1) * g
                v1 = b2 * v + (1 - b2) * g * g
                step = self.lr * (m1 / (1 - b1 ** t)) / (np.sqrt(v1 / (1 - b2 ** t)) + self.eps)
                ok = np.isfinite(m1) & np.isfinite(v1)
                step = np.where(ok & np.isfinite(step), step, 0.0)
                self.m[name] = np.where(ok, m1, m)
                self.v[name] = np.where(ok, v1, v)
                step = step + self.lr * self.wd * p.astype(np.float64)
                if self.max_delta > 0:
                    step = np.clip(step, -self.max_delta, self.max_delta)
                out[name] = p.astype(np.float64) - step
        return out


def test_adamw_matches_numpy_over_steps(lim):
    rt = lim
    rng = np.random.default_rng(0)
    shapes = {"a": (1,), "b": (300,), "c": (70_001,), "d": (17, 5)}
    p_np = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    g_steps = [{k: rng.standard_normal(s).astype(np.float32) * (i + 1) for k, s in shapes.items()}
               for i in range(5)]
    ft, pv = _flat_views(rt, list(p_np.values()))
    gt, gv = _flat_views(rt, [np.zeros(s, np.float32) for s in shapes.values()])
    params, grads = dict(zip(shapes, pv)), dict(zip(shapes, gv))
    opt = AdamW(rt, lr=1e-2, weight_decay=0.1)
    ref = RefAdamW(lr=1e-2, wd=0.1)
    cur = dict(p_np)
    worst = 0.0
    for gs in g_steps:
        for k in shapes:
            rt.write(grads[k], gs[k])
        _step(rt, opt, params, grads)
        cur = ref.step(cur, gs)
        for k in shapes:
            got = rt.read(params[k]).astype(np.float64)
            worst = max(worst, np.abs(got - cur[k]).max())
            np.testing.assert_allclose(got, cur[k], rtol=1e-5, atol=2e-6, err_msg=k)
    assert opt.step_count == 5
    sd = opt.state_dict()
    for k in shapes:
        np.testing.assert_allclose(sd[f"{k}.exp_avg"], ref.m[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sd[f"{k}.exp_avg_sq"], ref.v[k], rtol=1e-5, atol=1e-7)
    # the padding between views is untouched
    flat = rt.read(ft)
    mask = np.ones(flat.size, bool)
    for t in pv:
        o = t.offset // 4
        mask[o:o + t.numel] = False
    assert np.all(flat[mask] == 0.0)
    print(f"adamw vs numpy max |err| = {worst:.3g}")


def test_adamw_first_step_is_bias_corrected(rt):
    """t=1: m̂ = g, v̂ = g², so step = lr·g/(|g|+eps) ≈ lr·sign(g) regardless of |g|."""
    g = np.array([1e-3, -2.0, 50.0, -7e-2], np.float32)
    p = rt.upload(np.zeros(4, np.float32))
    gt = rt.upload(g)
    _step(rt, AdamW(rt, lr=1e-3, weight_decay=0.0), {"w": p}, {"w": gt})
    np.testing.assert_allclose(rt.read(p), -1e-3 * np.sign(g), rtol=1e-4)


def test_weight_decay_alone(rt):
    p0 = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    p, g = rt.upload(p0), rt.zeros((1000,))
    _step(rt, AdamW(rt, lr=0.1, weight_decay=0.5), {"w": p}, {"w": g})
    np.testing.assert_allclose(rt.read(p), p0 * (1 - 0.1 * 0.5), rtol=1e-6)


def test_trust_region_clamp(lim):
    rt = lim
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(5000).astype(np.float32)
    p, g = rt.upload(p0), rt.upload(rng.standard_normal(5000).astype(np.float32))
    opt = AdamW(rt, lr=0.1, weight_decay=0.0, max_delta=0.05)
    ref = RefAdamW(lr=0.1, wd=0.0, max_delta=0.05)
    cur = {"w": p0}
    for _ in range(3):
        prev = rt.read(p)
        _step(rt, opt, {"w": p}, {"w": g})
        cur = ref.step(cur, {"w": rt.read(g)})
        now = rt.read(p)
        delta = np.abs(now.astype(np.float64) - prev)
        assert delta.max() <= 0.05 * (1 + 1e-5) + 1e-6
        assert np.mean(delta > 0.049) > 0.5  # lr >> max_delta: most steps hit the clamp
        np.testing.assert_allclose(now, cur["w"], rtol=1e-5, atol=2e-6)


def test_trust_region_bounds_the_move_with_weight_decay(rt):
    """--max-delta caps the whole move of an element in one step, decay included (SPEC 4):
    with a large decay and a tiny Adam step, the decay alone would exceed the cap."""
    rng = np.random.default_rng(12)
    p0 = (rng.standard_normal(4000) * 5).astype(np.float32)
    g0 = (rng.standard_normal(4000) * 1e-3).astype(np.float32)
    p, g = rt.upload(p0), rt.upload(g0)
    opt = AdamW(rt, lr=1e-3, weight_decay=10.0, max_delta=1e-3)
    ref = RefAdamW(lr=1e-3, wd=10.0, max_delta=1e-3)
    cur = {"w": p0}
    for _ in range(3):
        prev = rt.read(p)
        _step(rt, opt, {"w": p}, {"w": g})
        cur = ref.step(cur, {"w": g0})
        now = rt.read(p)
        delta = np.abs(now.astype(np.float64) - prev)
        # the move is max_delta up to the f32 rounding of the new weight
        assert np.all(delta <= 1e-3 + np.spacing(np.abs(prev)))
        assert np.mean(delta > 0.99e-3) > 0.5  # lr*wd*|p| (about 0.04) is far above the cap
        np.testing.assert_allclose(now, cur["w"], rtol=1e-5, atol=2e-6)


def test_non_finite_gradients_never_reach_weights_or_moments(rt):
    rng = np.random.default_rng(3)
    n = 1000
    p0 = rng.standard_normal(n).astype(np.float32)
    g_ok = rng.standard_normal(n).astype(np.float32)
    p, g = rt.upload(p0), rt.upload(g_ok)
    opt = AdamW(rt, lr=1e-2, weight_decay=0.0)
    _step(rt, opt, {"w": p}, {"w": g})  # one normal step: non-zero moments
    before_p, before = rt.read(p), opt.state_dict()
    bad = g_ok.copy()
    bad[::7] = np.nan
    bad[3::7] = np.inf
    bad[5::7] = -np.inf
    bad[6::7] = 3e38  # finite, but g² overflows
    rt.write(g, bad)
    _step(rt, opt, {"w": p}, {"w": g})
    after_p, after = rt.read(p), opt.state_dict()
    hit = ~np.isfinite(bad) | (np.abs(bad) > 1e30)
    assert np.all(np.isfinite(after_p))
    assert np.array_equal(after_p[hit], before_p[hit])  # weight unchanged (wd = 0)
    assert not np.allclose(after_p[~hit], before_p[~hit])  # the others did step
    for key in ("w.exp_avg", "w.exp_avg_sq"):
        assert np.all(np.isfinite(after[key]))
        assert np.array_equal(after[key][hit], before[key][hit])  # moments untouched there
    # with weight decay the skipped elements still decay, exactly as SPEC's formula says
    opt2 = AdamW(rt, lr=1e-2, weight_decay=0.5)
    p2 = rt.upload(p0)
    _step(rt, opt2, {"w": p2}, {"w": g})
    np.testing.assert_allclose(rt.read(p2)[hit], p0[hit] * (1 - 1e-2 * 0.5), rtol=1e-6)


def test_clip_factor_is_applied(lim):
    rt = lim
    rng = np.random.default_rng(4)
    p0 = rng.standard_normal(3000).astype(np.float32)
    gs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    p, g = rt.upload(p0), rt.zeros((3000,))
    clip = rt.upload(np.array([0.25], np.float32))
    opt, ref, cur = AdamW(rt, lr=1e-2), RefAdamW(lr=1e-2), {"w": p0}
    for gi in gs:
        rt.write(g, gi)
        _step(rt, opt, {"w": p}, {"w": g}, clip)
        cur = ref.step(cur, {"w": gi}, clip=0.25)
    np.testing.assert_allclose(rt.read(p), cur["w"], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(opt.state_dict()["w.exp_avg"], ref.m["w"], rtol=1e-5, atol=1e-7)


def test_matches_torch_adamw(lim):
    rt = lim
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    shapes = {"x": (64, 33), "y": (1000,)}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
    topt = torch.optim.AdamW(list(tp.values()), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    params = {k: rt.upload(v) for k, v in p0.items()}
    grads = {k: rt.zeros(s) for k, s in shapes.items()}
    opt = AdamW(rt, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_delta=0.0)
    worst = 0.0
    for _ in range(10):
        for k, s in shapes.items():
            gi = rng.standard_normal(s).astype(np.float32)
            tp[k].grad = torch.tensor(gi)
            rt.write(grads[k], gi)
        topt.step()
        _step(rt, opt, params, grads)
    for k in shapes:
        want = tp[k].detach().numpy()
        got = rt.read(params[k])
        worst = max(worst, float(np.abs(got - want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        st = topt.state[tp[k]]
        # torch uses 1 - 0.999 in double; the SPEC's f32 uniform gives 1 - f32(0.999), which is
        # 1.3e-5 relative smaller: v differs by that much (the update itself by ~1e-7)
        np.testing.assert_allclose(opt.state_dict()[f"{k}.exp_avg_sq"], st["exp_avg_sq"].numpy(),
                                   rtol=3e-5, atol=1e-9)
        np.testing.assert_allclose(opt.state_dict()[f"{k}.exp_avg"], st["exp_avg"].numpy(),
                                   rtol=1e-5, atol=1e-7)
    print(f"adamw vs torch max |err| = {worst:.3g}")


def test_moments_are_keyed_by_name(rt):
    """all -> subset (other order) -> all (other order).  A, B, C have the same shape, so an
    index-keyed optimizer would silently pair C with A's moments and diverge from the ref."""
    rng = np.random.default_rng(6)
    names = ["A", "B", "C"]
    p_np = {k: rng.standard_normal(500).astype(np.float32) for k in names}
    params = {k: rt.upload(v) for k, v in p_np.items()}
    grads = {k: rt.zeros((500,)) for k in names}
    opt, ref, cur = AdamW(rt, lr=1e-2), RefAdamW(lr=1e-2), dict(p_np)
    schedule = [names, names, ["C", "A"], ["C", "A"], ["B", "C", "A"], names]
    seen = {}
    for sel in schedule:
        gs = {k: (rng.standard_normal(500) * (1 + names.index(k))).astype(np.float32) for k in sel}
        for k in sel:
            rt.write(grads[k], gs[k])
        _step(rt, opt, {k: params[k] for k in sel}, {k: grads[k] for k in sel})
        cur.update(ref.step({k: cur[k] for k in sel}, gs))
        for k in sel:
            seen.setdefault(k, opt.moments[k])
            assert opt.moments[k] is seen[k]  # the same moment tensors come back
        for k in names:
            np.testing.assert_allclose(rt.read(params[k]), cur[k], rtol=1e-5, atol=2e-6, err_msg=k)
    assert set(opt.moments) == set(names) and opt.step_count == len(schedule)
    sd = opt.state_dict()
    for k in names:
        np.testing.assert_allclose(sd[f"{k}.exp_avg"], ref.m[k], rtol=1e-5, atol=1e-7)


def test_one_uniform_buffer_written_once_per_step(rt, monkeypatch):
    opt = AdamW(rt, lr=1e-3)
    ps = {f"p{i}": rt.upload(np.ones(10 + i, np.float32)) for i in range(12)}
    gs = {k: rt.upload(np.full(v.numel, 0.5, np.float32)) for k, v in ps.items()}
    first = {k: ps[k] for k in list(ps)[:4]}
    _step(rt, opt, first, {k: gs[k] for k in first})
    buf = opt._ubuf
    _step(rt, opt, first, {k: gs[k] for k in first})
    assert opt._ubuf is buf and opt.uniform_buffers_created == 1
    # 12 names > initial capacity: grows once, then stays
    _step(rt, opt, ps, gs)
    assert opt.uniform_buffers_created == 2
    buf = opt._ubuf
    calls = []
    queue = rt.device.queue
    orig = type(queue).write_buffer

    def spy(self, buffer, *a, **kw):
        calls.append(buffer)
        return orig(self, buffer, *a, **kw)

    monkeypatch.setattr(type(queue), "write_buffer", spy)
    nuni = len(rt._uniforms)
    rec = rt.recorder()
    opt.record_step(rec, ps, gs)
    # one fused dispatch per parameter, and one for the last 1-3 elements of sizes not divisible by 4
    assert rec.dispatches == len(ps) + sum(p.numel % 4 != 0 for p in ps.values())
    rec.submit()
    monkeypatch.undo()
    assert calls == [buf] and opt._ubuf is buf and len(rt._uniforms) == nuni
    assert all(u.offset % rt.uniform_align == 0 and u.size == 48 for u in opt._uniforms.values())
    # 4 steps for p0..p3, 2 for the rest (global t = 4): check a late-comer against the ref
    ref = RefAdamW(lr=1e-3)
    cur = {k: np.ones(v.numel, np.float32) for k, v in ps.items()}
    g_np = {k: np.full(v.numel, 0.5, np.float32) for k, v in ps.items()}
    for sel in (list(first), list(first), list(ps), list(ps)):
        cur.update(ref.step({k: cur[k] for k in sel}, g_np))
    for k in ps:
        np.testing.assert_allclose(rt.read(ps[k]), cur[k], rtol=1e-6, err_msg=k)


def test_record_step_twice_without_submit_is_refused(rt):
    opt = AdamW(rt)
    p, g = rt.upload(np.ones(4, np.float32)), rt.zeros((4,))
    rec = rt.recorder()
    opt.record_step(rec, {"w": p}, {"w": g})
    with pytest.raises(RuntimeError):
        opt.record_step(rec, {"w": p}, {"w": g})
    rec.submit()


def test_misaligned_view_is_refused(rt):
    buf = rt.upload(np.ones(64, np.float32))
    g = rt.zeros((10,))
    with pytest.raises(ValueError):
        AdamW(rt).record_step(rt.recorder(), {"w": buf.view((10,), 1)}, {"w": g})


def test_state_dict_round_trip_continues_bit_exactly(lim, tmp_path):
    rt = lim
    rng = np.random.default_rng(8)
    shapes = {"layers.0.mixer.in_proj.weight": (40, 30), "norm_f.weight": (30,)}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    g_steps = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(6)]
    kw = dict(lr=1e-2, weight_decay=0.05, max_delta=0.004)
    pa = {k: rt.upload(v) for k, v in p0.items()}
    grads = {k: rt.zeros(s) for k, s in shapes.items()}
    a = AdamW(rt, **kw)

    def run(opt, params, steps):
        for gs in steps:
            for k in shapes:
                rt.write(grads[k], gs[k])
            _step(rt, opt, params, grads)

    run(a, pa, g_steps[:3])
    sd = a.state_dict()
    assert set(sd) == {f"{k}.{s}" for k in shapes for s in ("exp_avg", "exp_avg_sq")} | {"__step__"}
    assert int(sd["__step__"][0]) == 3
    from safetensors.numpy import load_file, save_file
    save_file(sd, str(tmp_path / "optimizer.safetensors"))
    loaded = load_file(str(tmp_path / "optimizer.safetensors"))
    b = AdamW(rt, **kw)
    b.load_state_dict(loaded)
    assert b.step_count == 3
    pb = {k: rt.upload(rt.read(v)) for k, v in pa.items()}
    run(a, pa, g_steps[3:])
    run(b, pb, g_steps[3:])
    for k in shapes:
        assert np.array_equal(rt.read(pa[k]).view(np.uint32), rt.read(pb[k]).view(np.uint32)), k
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k
    # a fresh optimizer (no load) does NOT continue identically: the test can tell
    c = AdamW(rt, **kw)
    c.step_count = 3
    pc = {k: rt.upload(rt.read(v)) for k, v in pa.items()}
    run(c, pc, g_steps[3:4])
    run(a, pa, g_steps[3:4])
    assert not np.array_equal(rt.read(pa["norm_f.weight"]), rt.read(pc["norm_f.weight"]))


# ---------------------------------------------------------------------------- clipping

def _clip_record(rt, clipper, grads, max_norm):
    rec = rt.recorder()
    clipper.record(rec, grads, max_norm)
    rec.submit()
    return float(rt.read(clipper.norm)[0]), float(rt.read(clipper.factor)[0])


def test_grad_clipper_norm_and_factor(lim):
    rt = lim
    rng = np.random.default_rng(9)
    sizes = [1, 1000, 70_001, 257]
    arrays = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    ft, views = _flat_views(rt, arrays, pad_value=1e3)  # padding would inflate the norm
    clipper = GradClipper(rt)
    want = float(np.sqrt(sum((a.astype(np.float64) ** 2).sum() for a in arrays)))
    norm, factor = _clip_record(rt, clipper, views, 1.0)
    assert abs(norm - want) <= 1e-6 * want, (norm, want)
    assert abs(factor - 1.0 / want) <= 1e-6 / want
    _, factor = _clip_record(rt, clipper, views, 2 * want)
    assert factor == 1.0
    _, factor = _clip_record(rt, clipper, views, 0.0)  # 0 disables clipping
    assert factor == 1.0
    # different gradients next step: the norm is this step's
    for v, a in zip(views, arrays):
        rt.write(v, a * 0.5)
    n2, _ = _clip_record(rt, clipper, views, 1.0)
    assert abs(n2 - want * 0.5) <= 1e-6 * want
    # deterministic
    bits = {rt.read(clipper.norm).view(np.uint32)[0] for _ in range(2) if _clip_record(rt, clipper, views, 1.0)}
    assert len(bits) == 1


def test_grad_clipper_non_finite_norm_gives_factor_one(rt):
    g = np.ones(5000, np.float32)
    g[1234] = np.nan
    clipper = GradClipper(rt)
    norm, factor = _clip_record(rt, clipper, [rt.upload(g)], 1.0)
    assert not np.isfinite(norm) and factor == 1.0


def test_clip_then_adamw_step_equals_reference(lim):
    rt = lim
    rng = np.random.default_rng(10)
    shapes = {"a": (3000,), "b": (70, 7)}
    p_np = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    g_np = {k: (rng.standard_normal(s) * 3).astype(np.float32) for k, s in shapes.items()}
    _, pv = _flat_views(rt, list(p_np.values()))
    _, gv = _flat_views(rt, list(g_np.values()))
    params, grads = dict(zip(shapes, pv)), dict(zip(shapes, gv))
    clipper, opt = GradClipper(rt), AdamW(rt, lr=1e-2)
    ref, cur = RefAdamW(lr=1e-2), dict(p_np)
    norm = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in g_np.values())))
    for _ in range(2):
        rec = rt.recorder()
        clipper.record(rec, list(grads.values()), 1.0)
        opt.record_step(rec, params, grads, clipper.factor)
        rec.submit()
        cur = ref.step(cur, g_np, clip=1.0 / norm)
    for k in shapes:
        np.testing.assert_allclose(rt.read(params[k]), cur[k], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(opt.state_dict()["a.exp_avg"], ref.m["a"], rtol=1e-5, atol=1e-8)


def test_whole_store_steps_equal_per_name_steps(lim):
    """A store that trains every view steps as its segments (one dispatch each, moments one
    flat pair): parameters and moments bit-identical to stepping name by name, also after
    moments loaded before the first step (a resume); the padding stays zero."""
    from memengine.engine.models.store import FlatStore
    from memengine.engine.runtime import Recorder

    rt = lim
    shapes = {"a": (5, 7), "b": (300,), "c": (3, 4, 9)}
    rng = np.random.default_rng(11)
    p0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    gs = [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for _ in range(3)]
    loaded = {f"{n}.{k}": np.abs(rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()
              for k in ("exp_avg", "exp_avg_sq")}
    loaded["__step__"] = np.array([4], np.int64)

    def run(whole, resume):
        P, G = FlatStore(rt, shapes, "tp"), FlatStore(rt, shapes, "tg")
        P.write(p0)
        opt = AdamW(rt, lr=1e-2, weight_decay=0.1)
        if resume:
            opt.load_state_dict(loaded)
        seen = []
        inner = Recorder.dispatch

        def counted(self, sh, en, *a, **k):
            seen.append(en)
            return inner(self, sh, en, *a, **k)

        Recorder.dispatch = counted
        try:
            for g in gs:
                G.write(g)
                rec = rt.recorder()
                opt.record_step(rec, P.views, G.views, whole=[(P, G)] if whole else ())
                rec.submit()
        finally:
            Recorder.dispatch = inner
        flat = rt.read(P.segments[0])
        return P.read(), opt.state_dict(), flat, seen.count("adamw_step")

    for resume in (False, True):
        pn, sn, _, n_names = run(False, resume)
        pw, sw, flat, n_whole = run(True, resume)
        for n in shapes:
            np.testing.assert_array_equal(pw[n], pn[n])
        assert sn.keys() == sw.keys()
        for k in sn:
            np.testing.assert_array_equal(sw[k], sn[k])
        used = np.zeros(flat.size, bool)
        P = FlatStore(rt, shapes, "tp2")
        for n, (_, off) in P.where.items():
            used[off:off + int(np.prod(shapes[n]))] = True
        assert np.all(flat[~used] == 0)
        assert n_whole < n_names, (n_whole, n_names)   # one dispatch per segment, not per name
