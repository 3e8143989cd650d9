#!/usr/bin/env bash
# The hybrids and the f16 scales on the H200 device machine, from the repo root, with .gl and
# .whl carried (DEVELOPERS.md; wgpudawn and transformers 5.24 among the wheels):
#   bash benchmarks/hybrid_h200.sh
# 1. --precision mixed's tests under Dawn, where the products run on subgroup matrices
#    (the per-tensor f16 scales included);
# 2. the attention kernels against torch's scaled_dot_product_attention (flash, bf16) at the
#    hybrids' head shapes, L 4096: errors at a small L, then forward + backward times;
# 3. bench.py's train suite at the granite-4.0-h-350m shape, B 1, L 4096: memengine fp32
#    (wgpu-native, with its kernel profile) and transformers' GraniteMoeHybridForCausalLM with
#    bf16 autocast and SDPA in the same run (its fast path needs mamba-ssm and causal-conv1d
#    built; without them it runs its PyTorch path, and the row says which);
# 4. the mamba-130m mixed step under Dawn (B 8, L 2048), no peer;
# 5. the attention and hybrid oracle tests on this GPU.
# Each step has a time limit; results under $OUT (or ./out).
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
MEMENGINE_BACKEND=dawn timeout "${MIXED_S:-120}" python3 -m pytest -q -p no:cacheprovider --tb=short \
    ${MIXED_TESTS:-tests/test_f16_scaling.py tests/test_mixed.py} > "$OUT/tests_mixed_dawn.txt" 2>&1
tail -2 "$OUT/tests_mixed_dawn.txt"
timeout "${ATTN_S:-90}" python3 benchmarks/attention_h200.py 2>&1 | tee "$OUT/attention.log" | tail -8
timeout "${HYBRID_S:-150}" python3 benchmarks/bench.py --suite train --shapes granite-4.0-h-350m --seq 4096 --batch 1 \
    --steps 3 --peer-steps 3 --lora-rank 0 --profile --out "$OUT/bench_hybrid.json" 2>&1 \
    | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/bench_hybrid.log" | tail -4
MEMENGINE_BACKEND=dawn timeout "${STEP_S:-80}" python3 benchmarks/bench.py --suite train --shapes mamba-130m --seq 2048 \
    --batch 8 --steps 3 --precision mixed --lora-rank 0 --no-torch --out "$OUT/bench_mixed.json" 2>&1 | grep "^train"
timeout "${TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_attention.py tests/test_hybrid.py \
    > "$OUT/tests_hybrid.txt" 2>&1
tail -2 "$OUT/tests_hybrid.txt"
