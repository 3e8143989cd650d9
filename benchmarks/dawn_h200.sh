#!/usr/bin/env bash
# The Dawn backend and its tensor-core products on the H200 device machine, from the repo
# root, with .gl, .whl (DEVELOPERS.md; wgpudawn==0.32.0.4 among the wheels) and .peers (a
# copy of ../shared/peers) carried:   bash benchmarks/dawn_h200.sh
# 1. mamba-ssm builds in the background (build_peers.sh) while
# 2. the adapter's facts are printed and the f16 products are checked on subgroup matrices
#    (tests/test_mixed.py's rounding-bound tests, every shader compiled under Tint);
# 3. bench.py's matmul suite (the mamba-130m step's products: fp32, f16 on subgroup
#    matrices, f16 without them, cuBLAS fp32 and bf16);
# 4. bench.py's train suite at B 8, L 2048 (and B 1): fp32 and --precision mixed under
#    Dawn, then mamba-ssm fp32 and bf16 autocast in the same run;
# 5. with TUNE_FORMS=a,b (before 2) benchmarks/sgmat_tune.py times those forms of the product;
# 6. with WGPU_TRAIN=1 the fp32 step on wgpu-native too; with ORACLE=1 (before 4) the oracle tests under Dawn and wgpu-native (Mamba-1, Mamba-2, mixed
#    precision; ORACLE_BACKENDS picks), their logs whole.
# With TESTS=0 step 2's tests are left out (TESTS_K= : all of tests/test_mixed.py, not only its
# rounding-bound tests), with MATMUL=0 step 3; STEPS (default 10): the timed training steps
# after bench.py's warm-up steps.
# Each step has its own time limit (STEP_S, default 150 s); results under $OUT (or ./out).
set -o pipefail
OUT=${OUT:-$PWD/out}
S=${STEP_S:-150}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
export MEMENGINE_BACKEND=dawn
(bash .peers/build_peers.sh > /tmp/peer_build.log 2>&1; touch /tmp/peers_done) &
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
timeout 60 python3 -c "
from memengine.engine.runtime import get_runtime
rt = get_runtime()
print(rt.describe(), 'f16', rt.has_f16, 'subgroups', rt.has_subgroups, 'subgroup matrices', rt.has_subgroup_matrix)
print(rt.backend.subgroup_matrix_configs(rt.adapter)); print(dict(rt.adapter.info))
" 2>&1 | tee "$OUT/adapter.txt"
if [ -n "${TUNE_FORMS:-}" ]; then
  timeout "$S" python3 benchmarks/sgmat_tune.py --forms "$TUNE_FORMS" --out "$OUT/sgmat_tune.json" 2>&1 \
      | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/sgmat_tune.log" | tail -12
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout "$S" python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_mixed.py -k "${TESTS_K-rounding_bound}" > "$OUT/tests_sgmat.txt" 2>&1
  tail -3 "$OUT/tests_sgmat.txt"
  timeout "$S" python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_backend.py -k tint >> "$OUT/tests_sgmat.txt" 2>&1
  tail -3 "$OUT/tests_sgmat.txt"
fi
if [ "${MATMUL:-1}" = 1 ]; then
  timeout "$S" python3 benchmarks/bench.py --suite matmul --shapes mamba-130m --out "$OUT/bench_matmul.json" 2>&1 \
      | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/bench_matmul.log"
fi
if [ "${ORACLE:-0}" = 1 ]; then   # before the peer is importable (transformers would take its kernels)
  for b in ${ORACLE_BACKENDS:-dawn wgpu}; do
    MEMENGINE_BACKEND=$b timeout "$S" python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_oracle.py \
        tests/test_mamba2.py tests/test_mixed.py > "$OUT/tests_oracle_$b.txt" 2>&1
    tail -3 "$OUT/tests_oracle_$b.txt"
  done
fi
export PYTHONPATH=/tmp/peers/mamba_ssm-2.3.2.post1:$PYTHONPATH
timeout $((S * 2)) python3 benchmarks/bench.py --suite train --shapes mamba-130m --seq 2048 --batch "${BATCH:-8}" \
    --precision fp32,mixed --steps "${STEPS:-10}" --peer-steps "${STEPS:-10}" --lora-rank 0 --profile --peer-wait 200 --peer-ready /tmp/peers_done --bf16-batches "${BATCH:-8}" \
    --out "$OUT/bench_train.json" 2>&1 | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/bench_train.log"
if [ "${WGPU_TRAIN:-0}" = 1 ]; then   # the same step on wgpu-native, fp32 (its best), for comparison
  MEMENGINE_BACKEND=wgpu timeout "$S" python3 benchmarks/bench.py --suite train --shapes mamba-130m --seq 2048 \
      --batch "${BATCH:-8}" --steps 3 --lora-rank 0 --no-torch --out "$OUT/bench_train_wgpu.json" 2>&1 \
      | grep --line-buffered "^train"
fi
tail -3 /tmp/peer_build.log
