# The two commands of the README. Each installs what it needs on a fresh machine.
#   make demo   tiny model, bundled text: init, train, adapt, quantize, eval
#   make test   the whole test suite (the oracle is transformers' MambaForCausalLM)
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: demo test setup setup-test bench

setup:
	@bash .ci/gpu-driver.sh
	$(PIP) install -q -e .

setup-test:
	@bash .ci/gpu-driver.sh
	$(PIP) install -q -e ".[test]"

demo: setup
	memengine demo

test: setup-test
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q

bench: setup-test
	$(PYTHON) benchmarks/bench.py --shapes tiny --seq 128 --batch 1
