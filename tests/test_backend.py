"""The backends: --backend auto|wgpu|dawn (MEMENGINE_BACKEND), the one error line where
Dawn cannot run, the backend in memengine.json and `info`, `devices` listing both, and
every shader compiling under naga (wgpu-native) and Tint (Dawn).

Dawn needs Mesa 25's lavapipe on a machine without a GPU (`bash .ci/mesa25.sh`; `make
test-dawn` runs this file with it): where Dawn sees no adapter, its half of the compile
test is skipped, and the refusal tests use that very machine."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import SAMPLE_TEXT
from test_cli import assert_one_line_error, run, run_proc

from memengine.engine import backend as eb
from memengine.engine.errors import NoAdapterError

SHADERS = Path(__file__).resolve().parent.parent / "shaders"
HAS_WGPUDAWN = importlib.util.find_spec("wgpudawn") is not None


def _preludes() -> set:
    """The shaders that are put in front of others (common, and each `// requires:` name)."""
    out = {"common", "subgroups_off"}
    for p in SHADERS.glob("*.wgsl"):
        first = p.read_text().split("\n", 1)[0]
        if first.startswith("// requires:"):
            out.update(r.strip() for r in first[len("// requires:"):].split(","))
    return out


KERNELS = sorted(p.stem for p in SHADERS.glob("*.wgsl") if p.stem not in _preludes())
# the subgroup probe calls subgroup built-ins itself: kernels/lanes.py runs it only where the
# device has subgroups (naga would take it without them, Tint rightly refuses)
SUBGROUPS_ONLY = {"lanes", "matmul_sgmat", "attention_sgmat"}
# the tensor-core kernels: only a device with f16 subgroup matrices compiles them (Dawn on a GPU
# that has them; kernels/matmul.py and kernels/attention.py take them only there; on lavapipe
# the tests run them through tests/sgmat_emulation.py)
SUBGROUP_MATRIX_ONLY = {"matmul_sgmat", "attention_sgmat"}


def _runtime(name: str):
    from memengine.engine.runtime import get_runtime

    try:
        return get_runtime(backend=name)
    except NoAdapterError as e:
        return str(e)


@pytest.fixture(scope="module")
def naga():
    rt = _runtime("wgpu")
    if isinstance(rt, str):
        pytest.skip(rt)
    return rt


@pytest.fixture(scope="module")
def tint():
    if not HAS_WGPUDAWN:
        pytest.skip("wgpudawn is not installed (pip install 'memengine[dawn]')")
    rt = _runtime("dawn")
    if isinstance(rt, str):
        pytest.skip(f"Dawn sees no adapter here ({rt}); `make test-dawn` runs this on Mesa 25's lavapipe")
    return rt


def _entries(code: str) -> list:
    return re.findall(r"@compute[^\n]*\n?\s*fn\s+(\w+)", code)


def _compile(rt, name: str, subgroups: bool) -> None:
    """The module as a run builds it (trusted), and a pipeline of each entry point."""
    if subgroups and not rt.has_subgroups:
        pytest.skip(f"{rt.describe()} has no subgroups")
    if not subgroups and name in SUBGROUPS_ONLY:
        pytest.skip(f"shaders/{name}.wgsl runs only where the device has subgroups")
    if name in SUBGROUP_MATRIX_ONLY and not rt.has_subgroup_matrix:
        pytest.skip(f"{rt.describe()} has no f16 subgroup matrices (shaders/{name}.wgsl runs only where it has)")
    code = rt.module_source(name, subgroups=subgroups)
    if "enable f16;" in code and not rt.has_f16:
        pytest.skip(f"{rt.describe()} has no shader-f16")
    mod = rt.backend.create_module(rt.device, name, code, rt.shader_checks)
    for entry in _entries(code):
        rt.device.create_compute_pipeline(label=f"{name}.{entry}", layout="auto",
                                          compute={"module": mod, "entry_point": entry})


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroups", "no-subgroups"])
@pytest.mark.parametrize("name", KERNELS)
def test_every_shader_compiles_under_naga(naga, name, subgroups):
    _compile(naga, name, subgroups)


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroups", "no-subgroups"])
@pytest.mark.parametrize("name", KERNELS)
def test_every_shader_compiles_under_tint(tint, name, subgroups):
    _compile(tint, name, subgroups)


# ----------------------------------------------------------------------------- selection
class FakeDawn(eb.Backend):
    """A Dawn stand-in: one adapter, with or without f16 subgroup matrices."""

    name, label = "dawn", "Dawn"

    def __init__(self, matrices: bool, adapters: int = 1):
        self.matrices, self.n = matrices, adapters

    def adapters(self):
        return [object()] * self.n

    def adapter_info(self, adapter):
        return {"device": "fake H200", "adapter_type": "DiscreteGPU", "backend_type": "Vulkan"}

    def adapter_features(self, adapter):
        return {"chromium-experimental-subgroup-matrix"} if self.matrices else set()

    def adapter_limits(self, adapter):
        return {}

    def has_f16_subgroup_matrices(self, adapter):
        return self.matrices


def test_auto_takes_dawn_only_for_mixed_runs_on_an_adapter_with_f16_subgroup_matrices(monkeypatch):
    monkeypatch.setitem(eb._MADE, "dawn", FakeDawn(matrices=True))
    found = {}
    b, _ = eb.open_adapter("auto", tensor_cores=True)
    assert b.name == "dawn"
    b, _ = eb.open_adapter("auto", found=found)   # an fp32 run: wgpu-native, Dawn's matrices noted
    assert b.name == "wgpu" and found == {"dawn_tensor_cores": True}
    monkeypatch.setitem(eb._MADE, "dawn", FakeDawn(matrices=False))
    found = {}
    b, _ = eb.open_adapter("auto", tensor_cores=True, found=found)
    assert b.name == "wgpu" and found == {"dawn_tensor_cores": False}
    monkeypatch.setitem(eb._MADE, "dawn", FakeDawn(matrices=True, adapters=0))
    assert eb.open_adapter("auto", tensor_cores=True)[0].name == "wgpu"


def test_auto_takes_wgpu_native_where_wgpudawn_is_not_installed(monkeypatch):
    monkeypatch.delitem(eb._MADE, "dawn", raising=False)
    monkeypatch.setitem(sys.modules, "wgpudawn", None)   # import wgpudawn -> ImportError
    monkeypatch.delitem(sys.modules, "memengine.engine.backend.dawn", raising=False)
    assert eb.open_adapter("auto")[0].name == "wgpu"
    with pytest.raises(NoAdapterError, match=r"--backend dawn: the dawn backend is not installed.*memengine\[dawn\]"):
        eb.open_adapter("dawn")


def test_auto_on_this_machine():
    """Neither lavapipe has subgroup matrices: auto is wgpu-native here, as on any adapter without them."""
    b, a = eb.open_adapter("auto")
    if HAS_WGPUDAWN:
        try:
            dawn = eb.get_backend("dawn")
            matrices = dawn.has_f16_subgroup_matrices(dawn.choose_adapter("auto"))
        except NoAdapterError:
            matrices = False
        assert b.name == "wgpu"   # an fp32 request
        assert eb.open_adapter("auto", tensor_cores=True)[0].name == ("dawn" if matrices else "wgpu")
    else:
        assert b.name == "wgpu"


def test_wgpu_and_dawn_are_taken_when_asked(tint):
    assert eb.open_adapter("wgpu")[0].name == "wgpu"
    assert eb.open_adapter("dawn")[0].name == "dawn"
    assert tint.describe().endswith("via Dawn") and tint.backend_name == "dawn"


def test_an_unknown_backend_is_one_line_naming_the_flag(tiny_ckpt_ro):
    r = run("info", tiny_ckpt_ro, "--backend", "vulkan")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--backend vulkan: must be one of auto, wgpu, dawn")
    r = run("info", tiny_ckpt_ro, env={"MEMENGINE_BACKEND": "metal"})
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--backend metal")


@pytest.mark.parametrize("cmd", ["info", "eval", "train", "adapt", "generate", "demo", "devices"])
def test_every_command_that_opens_a_device_takes_backend(cmd):
    r = run(cmd, "--help")
    assert r.exit_code == 0
    assert "--backend" in r.stdout and "MEMENGINE_BACKEND" in r.stdout


@pytest.mark.skipif(not HAS_WGPUDAWN, reason="wgpudawn is not installed")
def test_dawn_where_it_cannot_run_is_one_error_line_and_exit_2(tiny_ckpt_ro, tmp_path):
    """No Vulkan driver Dawn can open (VK_DRIVER_FILES naming none): one line, status 2."""
    text = tmp_path / "t.txt"
    text.write_text(SAMPLE_TEXT)
    env = {"VK_DRIVER_FILES": str(tmp_path / "none.json"), "VK_ICD_FILENAMES": str(tmp_path / "none.json")}
    r = run_proc("eval", tiny_ckpt_ro, "--data", text, "--backend", "dawn", env_extra=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, "--backend dawn: Dawn finds no adapter")
    r = run_proc("info", tiny_ckpt_ro, env_extra={**env, "MEMENGINE_BACKEND": "dawn"}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, "--backend dawn")


def test_dawn_not_installed_is_one_error_line_and_exit_2(tiny_ckpt_ro, sample_text, monkeypatch):
    from memengine.engine.runtime import runtime

    monkeypatch.setattr(runtime, "_RUNTIMES", {})   # a new runtime, not the one a test before made
    monkeypatch.delitem(eb._MADE, "dawn", raising=False)
    monkeypatch.setitem(sys.modules, "wgpudawn", None)
    monkeypatch.delitem(sys.modules, "memengine.engine.backend.dawn", raising=False)
    r = run("eval", tiny_ckpt_ro, "--data", sample_text, "--backend", "dawn")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "pip install 'memengine[dawn]'")


# ----------------------------------------------------------------------------- records
def test_the_backend_is_shown_and_recorded(tiny_ckpt_ro, sample_text, tmp_path, rt):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--epochs", "1", "--seq-len", "32")
    assert r.exit_code == 0, r.stderr
    assert f"via {rt.backend.label}" in r.stderr   # the run's adapter line
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["backend"] == rt.backend_name
    assert rec["segments"][-1]["backend"] == rt.backend_name
    r = run("info", out, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["backend"] == rt.backend_name
    r = run("info", out)
    assert re.search(rf"backend\s+{rt.backend_name}", r.stdout), r.stdout


def test_dawn_tells_the_gpus_memory_and_the_plan_takes_it(tint, naga, monkeypatch):
    """WebGPU gives no memory size; Dawn's memory heaps do. On lavapipe the device-local heap
    is the machine's memory (/proc/meminfo's MemTotal), on a GPU its own; wgpu-native tells
    none. The plan of a GPU adapter under Dawn checks its total against that size (a CPU
    adapter keeps MemAvailable, the closer figure)."""
    from memengine.engine.app import plan

    assert naga.device_memory is None
    mem = tint.device_memory
    assert isinstance(mem, int) and mem > 0
    if tint.adapter_type.lower() == "cpu":
        total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
        assert 0.5 * total <= mem <= 1.01 * total, (mem, total)
    monkeypatch.delenv(plan.ENV_MAX_MEMORY, raising=False)
    monkeypatch.setattr(tint, "adapter_type", "DiscreteGPU")
    lim = plan.Limits.of(tint)
    assert lim.memory == mem and "Dawn" in lim.memory_source
    monkeypatch.setattr(naga, "adapter_type", "DiscreteGPU")   # the same GPU under wgpu-native
    assert plan.Limits.of(naga).memory is None


def test_devices_lists_what_both_backends_see():
    r = run("devices", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    seen = {x["backend"] for x in d["devices"]} | {x["backend"] for x in d["unavailable"]}
    assert seen == {"wgpu", "dawn"}
    assert sum(x["auto"] for x in d["devices"]) == 1
    assert all("error" in x for x in d["unavailable"])


def test_dawn_profiles_kernels_with_unrounded_timestamps(tint):
    """Dawn rounds timestamp queries to 65.536 us unless its device toggle says otherwise,
    which made every kernel of a profile a multiple of that: the dawn backend turns it off."""
    import numpy as np
    from memengine.engine.kernels.activation import silu_forward

    if not tint.enable_profiling():
        pytest.skip("this adapter has no timestamp queries")
    try:
        x = tint.upload(np.linspace(-3, 3, 4099, dtype=np.float32))
        out = tint.empty((4099,))
        totals = []
        for _ in range(4):
            rec = tint.recorder()
            silu_forward(rec, out, x)
            rec.submit()
            totals += [ms for _, _, ms in tint.profile_report()]
    finally:
        tint.profiler = None
    assert totals and all(ms > 0 for ms in totals), totals
    # a rounded timestamp makes each difference, in ns, a multiple of 65536
    assert any(round(ms * 1e6) % 65536 for ms in totals), totals
