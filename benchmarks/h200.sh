#!/usr/bin/env bash
# One benchmark run on the H200 device machine, from the repo root, with .gl, .whl (see
# DEVELOPERS.md) and .peers (a copy of ../shared/peers) carried:
#   bash benchmarks/h200.sh [bench.py options]
# Builds mamba-ssm in the background while the kernel tests and our own measurements run,
# then bench.py measures the peer in the same process and prints the ratios.  With an
# older checkout in ./old (git archive REV | tar -x -C old), its scan suite runs too.
# Results under $OUT (or ./out).
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
(bash .peers/build_peers.sh > "$OUT/peer_build.log" 2>&1; touch /tmp/peers_done) &
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_scan.py tests/test_matmul.py tests/test_oracle.py tests/test_mixed.py tests/test_generate.py \
    tests/test_ops_elementwise.py tests/test_reduce.py tests/test_optim.py tests/test_lora.py tests/test_train.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
if [ -d old ]; then
  mkdir -p /tmp/oldpkg/memengine
  for d in cli engine shaders configs; do ln -sfn "$PWD/old/$d" "/tmp/oldpkg/memengine/$d"; done
  PYTHONPATH=/tmp/site:/tmp/oldpkg python3 old/benchmarks/bench.py --suite scan --variants --out "$OUT/old_scan.json" 2>&1 | grep scan | tee "$OUT/old_scan.log"
fi
export PYTHONPATH=/tmp/peers/mamba_ssm-2.3.2.post1:$PYTHONPATH
python3 benchmarks/bench.py "$@" --peer-wait 300 --peer-ready /tmp/peers_done --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
tail -3 "$OUT/peer_build.log"
