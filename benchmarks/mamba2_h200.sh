#!/usr/bin/env bash
# Mamba-2 on the H200 device machine, from the repo root, with .gl, .whl (DEVELOPERS.md;
# wgpudawn and transformers 5.24 among the wheels) and .peers (a copy of ../shared/peers)
# carried:   bash benchmarks/mamba2_h200.sh
# 0. the Mamba-2 oracle tests on this GPU under Dawn (ORACLE=0 skips);
# 1. bench.py's train suite at the mamba2-130m shape, B 8, L 2048, under Dawn: memengine fp32
#    and --precision mixed (tensor-core products) and, in the same run, mamba-ssm 2.3.2's
#    Mamba2 (Triton SSD kernels, fp32 with TF32 off and bf16 autocast; its Python sources
#    unbuilt, so torch's conv1d, not causal-conv1d). Its autotuner compiles about 200
#    configurations of the SSD kernels on first use, one after the other: more than the
#    rest of a call leaves (twelve processes compiling a share each had not finished after
#    180 s), so the peer's rows need a call of their own (BENCH_S up to 540); PRECOMPILE=1
#    first runs benchmarks/peer_precompile.py (each of WORKERS processes compiles a share of
#    every autotuned kernel's configurations at batch 2: 205 s with WORKERS=14 on an H100,
#    after which the bench's peer rows ran within BENCH_S=330, results/h100/sgmat_interior/);
# 2. the fp32 step on wgpu-native with its kernel profile (no peer; WGPU=0 skips);
# 3. with CODESTRAL=1: the mamba-codestral-7b plan (`memengine info`) and one measured
#    training step at B 1, L 2048 with its peak memory.
# Each step has a time limit; results under $OUT (or ./out).
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
PEER=/tmp/peers/mamba_ssm-2.3.2.post1
mkdir -p /tmp/peers && tar xzf .peers/mamba_ssm-2.3.2.post1.tar.gz -C /tmp/peers
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${ORACLE:-1}" = 1 ]; then   # before the peer is importable (transformers would take its kernels)
  MEMENGINE_BACKEND=dawn timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/test_mamba2.py > "$OUT/tests_mamba2.txt" 2>&1
  tail -3 "$OUT/tests_mamba2.txt"
fi
if [ "${PRECOMPILE:-0}" = 1 ]; then   # the peer's Triton kernels compiled ahead by worker processes
  PYTHONPATH=$PEER:$PYTHONPATH timeout "${PRECOMPILE_S:-240}" python3 benchmarks/peer_precompile.py \
      --shape mamba2-130m --seq 2048 --workers "${WORKERS:-12}" 2>&1 | tail -3 | tee "$OUT/precompile.txt"
fi
PYTHONPATH=$PEER:$PYTHONPATH MEMENGINE_BACKEND=dawn timeout "${BENCH_S:-300}" python3 benchmarks/bench.py \
    --suite train --shapes mamba2-130m --seq 2048 --batch 8 --steps 3 --peer-steps 3 --lora-rank 0 \
    --precision fp32,mixed --profile --out "$OUT/bench_mamba2.json" 2>&1 | grep --line-buffered -v "^\[transformers\]" \
    | tee "$OUT/bench_mamba2.log" | grep --line-buffered -E "^train|tok/s|mamba-ssm|error" | tail -20
if [ "${WGPU:-1}" = 1 ]; then
  MEMENGINE_BACKEND=wgpu timeout "${WGPU_S:-120}" python3 benchmarks/bench.py --suite train --shapes mamba2-130m \
      --seq 2048 --batch 8 --steps 3 --lora-rank 0 --no-torch --profile --out "$OUT/bench_mamba2_wgpu.json" 2>&1 \
      | grep --line-buffered "^train"
fi
if [ "${CODESTRAL:-0}" = 1 ]; then
  python3 -m memengine.cli.main info mamba-codestral-7b --seq-len 2048 --batch-size 1 > "$OUT/codestral_info.txt" 2>&1
  MEMENGINE_BACKEND=wgpu timeout "${CODESTRAL_S:-200}" python3 benchmarks/bench.py --suite train --shapes mamba-codestral-7b \
      --seq 2048 --batch 1 --steps 2 --lora-rank 0 --no-torch --out "$OUT/bench_codestral.json" 2>&1 \
      | tee "$OUT/bench_codestral.log" | tail -3
fi
