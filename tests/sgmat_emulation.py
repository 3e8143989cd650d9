"""Subgroup matrices emulated in plain WGSL, so that a kernel written for them
(shaders/matmul_sgmat.wgsl) runs its own indexing, staging and epilogues on an adapter
without them (lavapipe): a test of the kernel's logic, not of the hardware.

A subgroup is 32 consecutive invocations (`tid / 32`, as on NVIDIA) whatever the adapter's
subgroups are; the kernel's subgroup builtins become the emulation's. Lane l of a subgroup
holds, of a 16 x 16 result, row l / 2, columns 8 (l % 2) .. + 7 (`SMatC`, 8 floats); of a
left matrix, that whole row (`SMatL`); of a right matrix, those 8 columns whole (`SMatR`), so
that subgroupMatrixMultiplyAccumulate is each lane's own 8 dot products (f32, fused, in k
order) and needs neither barriers nor other lanes. subgroupMatrixLoad reads the elements
the lane holds (row-major: element (r, c) at offset + r * stride + c; column-major: offset +
c * stride + r; f16 exact in f32); subgroupMatrixStore writes a result's; a scalar multiply
scales them. Where the hardware rounds (its f32 additions truncate) the emulation rounds to
nearest, inside every bound the tests hold the hardware to. (A first form held whole
matrices in each invocation: lavapipe took minutes to compile it; one exchanging elements
through workgroup memory between barriers hung lavapipe's matmul_sgmat.)
"""

from __future__ import annotations

import contextlib
import re

N = 16          # the matrices' side
SUBGROUP = 32   # invocations a subgroup
PER = N * N // SUBGROUP   # elements a lane holds


def _calls(src: str, name: str):
    """(start, end, args) of every call `name(...)` / `name<...>(...)` in src, args split at
    the top-level commas."""
    out = []
    for m in re.finditer(r"\b%s\b" % re.escape(name), src):
        i = m.end()
        if src[i] == "<":   # template list, nested <>
            depth = 0
            while True:
                depth += {"<": 1, ">": -1}.get(src[i], 0)
                i += 1
                if depth == 0:
                    break
        if src[i] != "(":
            continue
        depth, j, args, cur = 0, i, [], ""
        while True:
            ch = src[j]
            if ch == "(":
                depth += 1
                if depth == 1:
                    j += 1
                    continue
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    args.append(cur.strip())
                    break
            if ch == "," and depth == 1:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
            j += 1
        out.append((m.start(), j + 1, args))
    return out


def _replace_calls(src: str, name: str, fn) -> str:
    """Each call rewritten by fn(args), the last first (so a nested call goes before the one
    around it), found again after each rewrite."""
    while True:
        calls = _calls(src, name)
        if not calls:
            return src
        start, end, args = calls[-1]
        src = src[:start] + fn(args) + src[end:]


def _elem_type(src: str, arr: str) -> str:
    m = re.search(r"var(?:<[^>]*>)?\s+%s\s*:\s*array<\s*(\w+)" % re.escape(arr), src)
    if not m:
        raise ValueError(f"no array declaration for {arr}")
    return m.group(1)


def _access(arr: str, kind: str, elem: str = "") -> str:
    """The emulated load (kind left / right / result) or store (store: of a result) of one
    array: the elements the lane holds (see the module's docstring)."""
    idx = """
        var i = off + r * stride + c;
        if (cm) { i = off + c * stride + r; }"""
    if kind == "store":
        return f"""
fn sms_{arr}(off: u32, m: SMatC, cm: bool, stride: u32) {{
    for (var j = 0u; j < {PER}u; j++) {{
        let r = EMU_LANE / 2u; let c = (EMU_LANE % 2u) * {PER}u + j;{idx}
        {arr}[i] = {elem}(m.v[j]);
    }}
}}"""
    if kind == "left":   # row EMU_LANE / 2
        loop, t, slot = f"for (var j = 0u; j < {N}u; j++) {{\n        let r = EMU_LANE / 2u; let c = j;", "SMatL", "j"
    elif kind == "right":   # columns (EMU_LANE % 2) * 8 .. + 7, every row k
        loop, t, slot = (f"for (var j = 0u; j < {N * PER}u; j++) {{\n        let r = j / {PER}u; "
                         f"let c = (EMU_LANE % 2u) * {PER}u + j % {PER}u;", "SMatR", "j")
    else:
        loop, t, slot = f"for (var j = 0u; j < {PER}u; j++) {{\n        let r = EMU_LANE / 2u; let c = (EMU_LANE % 2u) * {PER}u + j;", "SMatC", "j"
    return f"""
fn sml_{kind}_{arr}(off: u32, cm: bool, stride: u32) -> {t} {{
    var m: {t};
    {loop}{idx}
        m.v[{slot}] = f32({arr}[i]);
    }}
    return m;
}}"""


HELPERS = f"""
struct SMatL {{ v: array<f32, {N}> }}
struct SMatR {{ v: array<f32, {N * PER}> }}
struct SMatC {{ v: array<f32, {PER}> }}
var<private> EMU_LANE: u32;
fn smma(a: SMatL, b: SMatR, c: SMatC) -> SMatC {{
    var o = c;
    for (var j = 0u; j < {PER}u; j++) {{
        var s = o.v[j];
        for (var k = 0u; k < {N}u; k++) {{ s = fma(a.v[k], b.v[k * {PER}u + j], s); }}
        o.v[j] = s;
    }}
    return o;
}}
fn ssm(a: SMatC, x: f32) -> SMatC {{
    var o = a;
    for (var j = 0u; j < {PER}u; j++) {{ o.v[j] = o.v[j] * x; }}
    return o;
}}
"""


def emulate(src: str) -> str:
    """The WGSL of a subgroup-matrix kernel (its module source, preludes included) rewritten
    to run without subgroup matrices (see the module's docstring)."""
    s = re.sub(r"^enable chromium_experimental_subgroup_matrix;\n", "", src, flags=re.M)
    s = re.sub(r"^diagnostic\(off, chromium_experimental\.subgroup_matrix_uniformity\);\n", "", s, flags=re.M)
    s = re.sub(r"^enable subgroups;\n", "", s, flags=re.M)
    s = re.sub(r"subgroupMatrixLoad<subgroup_matrix_(left|right|result)<[^>]*>>", r"subgroupMatrixLoad_\1", s)
    s = re.sub(r"subgroup_matrix_left<[^>]*>", "SMatL", s)
    s = re.sub(r"subgroup_matrix_right<[^>]*>", "SMatR", s)
    s = re.sub(r"subgroup_matrix_result<[^>]*>", "SMatC", s)
    # naga (wgpu-native) has no bitcast of u32 to vec2<f16>: the same halves by unpacking
    s = re.sub(r"bitcast<vec2<f16>>\(([^()]*)\)", r"vec2<f16>(unpack2x16float(\1))", s)
    loads, stores = set(), set()

    def load(kind):
        def f(args):
            arr = args[0].lstrip("&").strip("()")
            loads.add((kind, arr))
            return f"sml_{kind}_{arr}({args[1]}, {args[2]}, {args[3]})"
        return f

    def store(args):
        arr = args[0].lstrip("&").strip("()")
        stores.add(arr)
        return f"sms_{arr}({args[1]}, {args[2]}, {args[3]}, {args[4]})"

    for kind in ("left", "right", "result"):
        s = _replace_calls(s, f"subgroupMatrixLoad_{kind}", load(kind))
    s = _replace_calls(s, "subgroupMatrixStore", store)
    s = _replace_calls(s, "subgroupMatrixMultiplyAccumulate", lambda a: f"smma({', '.join(a)})")
    s = _replace_calls(s, "subgroupMatrixScalarMultiply", lambda a: f"ssm({', '.join(a)})")
    extra = [HELPERS]
    extra += [_access(arr, kind) for kind, arr in sorted(loads)]
    extra += [_access(arr, "store", _elem_type(s, arr)) for arr in sorted(stores)]
    # the subgroup builtins of every entry point: the emulation's subgroup and lane
    def entry(m):
        head = m.group(0)
        if "local_invocation_index" not in head:
            return head
        names = {}
        for b in ("subgroup_id", "subgroup_invocation_id", "subgroup_size"):
            mb = re.search(r"@builtin\(%s\)\s*(\w+)\s*:\s*u32\s*,?\s*" % b, head)
            if mb:
                names[b] = mb.group(1)
                head = head[:mb.start()] + head[mb.end():]
        head = re.sub(r",\s*\)", ")", head)   # a trailing comma left by a removed parameter
        tid = re.search(r"@builtin\(local_invocation_index\)\s*(\w+)\s*:\s*u32", head).group(1)
        lets = {"subgroup_id": f"{tid} / {SUBGROUP}u", "subgroup_invocation_id": "EMU_LANE",
                "subgroup_size": f"{SUBGROUP}u"}
        body = f"\n    EMU_LANE = {tid} % {SUBGROUP}u;"
        body += "".join(f"\n    let {name} = {lets[b]};" for b, name in names.items())
        return head + body

    s = re.sub(r"\bfn\s+\w+\s*\([^{]*\{", entry, s)
    # after the directives (which must lead the module)
    lines = s.split("\n")
    head = 0
    while head < len(lines) and lines[head].startswith(("enable ", "diagnostic(", "requires ")):
        head += 1
    return "\n".join(lines[:head] + extra + lines[head:])


@contextlib.contextmanager
def emulated(rt, shader="matmul_sgmat"):
    """The runtime with `shader` (a name or several) compiled through emulate() and
    has_subgroup_matrix on, for
    the block. Only for an adapter without subgroup matrices (else the real kernel's caches
    would mix with the emulation's). The emulated pipelines stay cached after the block, for
    the next one: they compile slowly on lavapipe, and nothing else uses that shader there."""
    assert not rt.has_subgroup_matrix, "the adapter has subgroup matrices: run the kernel itself"
    saved = (rt.kernels.sgmat, rt.module_source)
    shaders = (shader,) if isinstance(shader, str) else tuple(shader)

    def source(name, subgroups=None):
        code = saved[1](name, subgroups)
        return emulate(code) if name in shaders else code

    rt.module_source = source
    rt.has_subgroup_matrix = True
    rt.kernels.sgmat = True
    try:
        yield rt
    finally:
        rt.has_subgroup_matrix, rt.kernels.sgmat = False, saved[0]
        del rt.module_source
