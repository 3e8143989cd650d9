# The two commands of the README. Each installs what it needs on a fresh machine (the
# Vulkan driver when there is no GPU adapter, and a project virtualenv in .venv, so the
# system Python is never modified).
#   make demo   tiny model, bundled text: init, train, adapt, quantize, eval, generate
#   make test   the whole test suite (the oracles are transformers' Mamba, Mamba2 and hybrid models)
#   make test-slow  the tests marked slow (minutes on a software adapter: real model sizes, and
#                   llama.cpp running exported GGUF files)
#   make test-dawn  the GPU tests again through the Dawn backend (MEMENGINE_BACKEND=dawn), on Mesa
#                   25's lavapipe where there is no GPU (.ci/mesa25.sh unpacks it into .cache/mesa25;
#                   the system's Mesa, which the other targets use, stays as it is)
VENV ?= .venv
PY := $(VENV)/bin/python

# the Dawn pass (about 5 minutes on 2 cores): the backends' own tests (selection, records, every
# shader under naga and Tint), the transformers oracles of Mamba-1 / Falcon-Mamba (test_oracle)
# and Mamba-2 (logits, loss, every gradient), the kernels' oracles (matmul, scan, row ops,
# reductions, AdamW, copies, mixed precision), decoding against transformers' generate, and
# LoRA against PEFT. Left out: the products whose 128-row tiles take
# lavapipe 1.5-3 minutes each to compile from Tint's SPIR-V (the same kernels' other tiles and
# shapes run), and the tests marked slow.
DAWN_TESTS ?= tests/test_backend.py tests/test_oracle.py tests/test_mamba2.py tests/test_matmul.py \
	tests/test_scan.py tests/test_ops_elementwise.py tests/test_reduce.py tests/test_optim.py \
	tests/test_copy.py tests/test_mixed.py tests/test_generate.py tests/test_lora.py tests/test_attention.py \
	tests/test_hybrid.py
DAWN_DESELECT ?= \
	--deselect "tests/test_matmul.py::test_every_tile_configuration_matches_numpy[128x64x16-0]" \
	--deselect "tests/test_matmul.py::test_every_tile_configuration_matches_numpy[128x64x16-1]" \
	--deselect "tests/test_matmul.py::test_every_tile_configuration_matches_numpy[64x128x16-1]" \
	--deselect tests/test_matmul.py::test_modules_with_and_without_naga_checks_give_the_same_bits \
	--deselect "tests/test_mixed.py::test_matmul_f16_within_the_rounding_bound[False-False-132-76-68]"

.PHONY: demo test test-slow test-dawn setup setup-test setup-slow bench

# stamps: reinstall only when the project's metadata changes
$(VENV)/.installed: pyproject.toml .ci/venv.sh
	@bash .ci/gpu-driver.sh
	@bash .ci/venv.sh $(VENV)
	@touch $@

$(VENV)/.installed-test: pyproject.toml .ci/venv.sh
	@bash .ci/gpu-driver.sh
	@bash .ci/venv.sh $(VENV) test
	@touch $@ $(VENV)/.installed

# test-slow also installs llama.cpp (llama-cpp-python, compiled on its first install), the
# oracle of the GGUF export tests
$(VENV)/.installed-slow: pyproject.toml .ci/venv.sh
	@bash .ci/gpu-driver.sh
	@bash .ci/venv.sh $(VENV) test,llama
	@touch $@ $(VENV)/.installed-test $(VENV)/.installed

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test
setup-slow: $(VENV)/.installed-slow

demo: setup
	$(VENV)/bin/memengine demo

test: setup-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-dawn: setup-test
	@eval "$$(bash .ci/mesa25.sh)" && MEMENGINE_BACKEND=dawn HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(DAWN_TESTS) $(DAWN_DESELECT)

test-slow: setup-slow
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

bench: setup-test
	$(PY) benchmarks/bench.py --shapes tiny --seq 128 --batch 1
