#!/usr/bin/env bash
# A Mamba-2 training step on the H200 (the sequential SSD scan): mamba2-130m shape, B 8, L 2048,
# on the bundled text; tokens/s per step from --json.  Source benchmarks/device_setup.sh first.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
W=$(mktemp -d)
python3 -m memengine.cli.main init mamba2-130m -o "$W/m" --seed 0 > /dev/null
python3 -m memengine.cli.main train "$W/m" --data engine/data/demo.txt -o "$W/t" --seq-len 2048 --batch-size 8 \
    --max-steps "${STEPS:-3}" --log-every 1 --json 2> "$OUT/mamba2_train.err" | tee "$OUT/mamba2_train.jsonl" \
    | python3 -c "import json,sys; [print('mamba2-130m B8 L2048 step', e['step'], round(e['tokens_per_s']), 'tokens/s') for e in map(json.loads, sys.stdin) if e.get('event') == 'step']"
