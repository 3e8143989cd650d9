# The two commands of the README. Each installs what it needs on a fresh machine (the
# Vulkan driver when there is no GPU adapter, and a project virtualenv in .venv, so the
# system Python is never modified).
#   make demo   tiny model, bundled text: init, train, adapt, quantize, eval, generate
#   make test   the whole test suite (the oracle is transformers' MambaForCausalLM)
#   make test-slow  the tests marked slow (minutes on a software adapter: real model sizes, and
#                   llama.cpp running exported GGUF files)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-slow setup setup-test setup-slow bench

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

test-slow: setup-slow
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

bench: setup-test
	$(PY) benchmarks/bench.py --shapes tiny --seq 128 --batch 1
