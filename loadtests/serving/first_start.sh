#!/usr/bin/env bash
# What a newcomer meets with each model, side by side in one run: `make serve`'s
# start time (launch to "Serving at", the GGUF already converted into the cache),
# then TTFT at concurrency 1 and served output tok/s at 64 streams, through HTTP.
#   bash loadtests/serving/first_start.sh [MODEL ...]     (default: tiny smollm2-135m)
# Writes results/first_start/<model>-*.txt; prints one summary line per model.
set -euo pipefail
cd "$(dirname "$0")/../.."
source loadtests/serving/launcher.sh
models=("${@:-tiny}")
[ $# -gt 0 ] || models=(tiny smollm2-135m)
out=results/first_start
mkdir -p "$out"
port=8123
for model in "${models[@]}"; do
  log="$out/$model-serve.txt"
  start=$(date +%s.%N)
  start_launcher "$log" --model "$model" --port "$port"
  ready=$(date +%s.%N)
  .venv/bin/python -m loadtests.bench --port "$port" --model "$model" --dataset-name random \
      --input-len 128 --output-len 32 --num-prompts 8 --max-concurrency 1 --ignore-eos \
      > "$out/$model-c1.txt" 2>&1
  .venv/bin/python -m loadtests.bench --port "$port" --model "$model" --dataset-name random \
      --input-len 128 --output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos \
      > "$out/$model-c64.txt" 2>&1
  stop_launcher
  ttft=$(grep -m1 "Median TTFT" "$out/$model-c1.txt" | awk '{print $NF}')
  toks=$(grep -m1 "Output token throughput" "$out/$model-c64.txt" | awk '{print $NF}')
  printf '%s: start %.1f s, median TTFT at concurrency 1 %s ms, output tok/s at 64 streams %s\n' \
      "$model" "$(echo "$ready - $start" | bc)" "$ttft" "$toks"
  sleep 3
done
