#!/usr/bin/env bash
# Interleaved A/B of the training step on the device machine: this checkout against an older one
# in ./old (git archive REV cli engine shaders configs benchmarks/bench.py | tar -x -C old; OLD=dir
# names another such folder),
# carried with .gl and .whl. Results under $OUT: ab.txt (one line per run, new and old in turn),
# new<r>.json, old<r>.json and their logs.
# ARGS: bench.py's arguments (default: mamba-130m, B 8, L 2048, fp32, 10 steps); ROUNDS (3);
# MATMUL=1: bench.py's matmul suite of each, once, first (matmul_new.json, matmul_old.json);
# TESTS=0: without the tests at the end. The backend: MEMENGINE_BACKEND, as everywhere.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source benchmarks/device_setup.sh
OLD=${OLD:-old}
rm -rf /tmp/oldpkg; mkdir -p /tmp/oldpkg/memengine; for d in cli engine shaders configs; do ln -sfn $PWD/$OLD/$d /tmp/oldpkg/memengine/$d; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > $OUT/gpu.txt
A=${ARGS:-"--suite train --shapes mamba-130m --batch 8 --seq 2048 --steps 10 --no-torch --lora-rank 0"}
if [ "${MATMUL:-0}" = 1 ]; then
 PYTHONPATH=/tmp/site:/tmp/pkg python3 benchmarks/bench.py --suite matmul --shapes mamba-130m --out $OUT/matmul_new.json 2>&1 | grep -v "^\[transformers\]" > $OUT/matmul_new.log
 PYTHONPATH=/tmp/site:/tmp/oldpkg python3 $OLD/benchmarks/bench.py --suite matmul --shapes mamba-130m --out $OUT/matmul_old.json 2>&1 | grep -v "^\[transformers\]" > $OUT/matmul_old.log
 tail -2 $OUT/matmul_new.log $OUT/matmul_old.log
fi
for r in $(seq 1 "${ROUNDS:-3}"); do
 PYTHONPATH=/tmp/site:/tmp/pkg python3 benchmarks/bench.py $A --out $OUT/new$r.json 2>&1 | tee $OUT/new$r.log | grep "memengine " | sed "s/^/new$r /" | tee -a $OUT/ab.txt
 PYTHONPATH=/tmp/site:/tmp/oldpkg python3 $OLD/benchmarks/bench.py $A --out $OUT/old$r.json 2>&1 | tee $OUT/old$r.log | grep "memengine " | sed "s/^/old$r /" | tee -a $OUT/ab.txt
done
if [ "${TESTS:-1}" = 1 ]; then
 python3 -m pytest -q -p no:cacheprovider -x tests/test_oracle.py tests/test_generate.py tests/test_mixed.py tests/test_train.py tests/test_architecture_seam.py tests/test_lora.py tests/test_scan.py tests/test_matmul.py 2>&1 | tail -3 | tee $OUT/tests.txt
fi
