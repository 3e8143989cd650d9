#!/usr/bin/env bash
# Interleaved A/B of the training step on the H200: this checkout against an older one in ./old
# (git archive REV cli engine shaders configs benchmarks/bench.py | tar -x -C old), carried with .gl and .whl.
# Results under $OUT: ab.txt (one line per run, new and old in turn), new<r>.json, old<r>.json.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source benchmarks/device_setup.sh
mkdir -p /tmp/oldpkg/memengine; for d in cli engine shaders configs; do ln -sfn $PWD/old/$d /tmp/oldpkg/memengine/$d; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > $OUT/gpu.txt
A="--suite train --shapes mamba-130m --batch 8 --seq 2048 --steps 10 --no-torch --lora-rank 0"
for r in 1 2 3; do
 PYTHONPATH=/tmp/site:/tmp/pkg python3 benchmarks/bench.py $A --out $OUT/new$r.json 2>&1 | grep "memengine " | sed "s/^/new$r /" | tee -a $OUT/ab.txt
 PYTHONPATH=/tmp/site:/tmp/oldpkg python3 old/benchmarks/bench.py $A --out $OUT/old$r.json 2>&1 | grep "memengine " | sed "s/^/old$r /" | tee -a $OUT/ab.txt
done
python3 -m pytest -q -p no:cacheprovider -x tests/test_oracle.py tests/test_generate.py tests/test_mixed.py tests/test_train.py tests/test_architecture_seam.py tests/test_lora.py tests/test_scan.py tests/test_matmul.py 2>&1 | tail -3 | tee $OUT/tests.txt
