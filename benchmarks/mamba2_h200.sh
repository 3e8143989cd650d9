#!/usr/bin/env bash
# Mamba-2 on the H200 device machine, from the repo root, with .gl, .whl (DEVELOPERS.md) and
# .peers (a copy of ../shared/peers) carried:   bash benchmarks/mamba2_h200.sh
# 1. bench.py's train suite at the mamba2-130m shape, B 8, L 2048: memengine fp32 (a step's
#    kernel profile too) and, in the same run, mamba-ssm 2.3.2's Mamba2 (Triton SSD kernels,
#    fp32 with TF32 off and bf16 autocast; its Python sources unbuilt, torch's conv1d);
# 2. the Mamba-2 oracle tests on this GPU;
# 3. with CODESTRAL=1: the mamba-codestral-7b plan (`memengine info`) and one measured
#    training step at B 1, L 2048 with its peak memory.
# Results under $OUT (or ./out).
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
mkdir -p /tmp/peers && tar xzf .peers/mamba_ssm-2.3.2.post1.tar.gz -C /tmp/peers
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
PYTHONPATH=/tmp/peers/mamba_ssm-2.3.2.post1:$PYTHONPATH timeout "${BENCH_S:-480}" python3 benchmarks/bench.py \
    --suite train --shapes mamba2-130m --seq 2048 --batch 8 --steps 3 --peer-steps 3 --lora-rank 0 --profile \
    --out "$OUT/bench_mamba2.json" 2>&1 | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/bench_mamba2.log"
python3 -m pytest -q -p no:cacheprovider tests/test_mamba2.py 2>&1 | tail -3 | tee "$OUT/tests_mamba2.txt"
if [ "${CODESTRAL:-0}" = 1 ]; then
  python3 -m memengine.cli.main info mamba-codestral-7b --seq-len 2048 --batch-size 1 > "$OUT/codestral_info.txt" 2>&1
  python3 benchmarks/bench.py --suite train --shapes mamba-codestral-7b --seq 2048 --batch 1 --steps 2 \
      --lora-rank 0 --no-torch --out "$OUT/bench_codestral.json" 2>&1 | tee "$OUT/bench_codestral.log"
fi
