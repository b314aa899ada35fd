#!/usr/bin/env bash
# Quantized weights through `make serve`'s launcher, side by side in one run: for each
# row of flags, a lone stream (8 requests one after another, 128-token prompts, 128
# tokens out, greedy, ignore_eos) and 64 streams (128 requests, 64 at a time), and
# the engine replicas' resident memory after them. First this machine's read
# bandwidth and a 128-token prompt's GEMM time (bench_engine --limits).
#   bash loadtests/serving/quant_serving.sh [MODEL]      (default: smollm2-135m)
#   ROWS="auto|none" bash loadtests/serving/quant_serving.sh   (rows: flags after --quantization)
# Writes results/quant_serving/*.txt; prints one line per row.
set -euo pipefail
cd "$(dirname "$0")/../.."
source loadtests/serving/launcher.sh
model="${1:-smollm2-135m}"
IFS='|' read -r -a rows <<< "${ROWS:-auto|none|auto --no-use-idle-cores|none --no-use-idle-cores}"
out=results/quant_serving
mkdir -p "$out"
port=8125
grep -o -E 'avx512[a-z_0-9]*|avx2|fma|f16c|amx[a-z_]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' \
  | sed 's/^/CPU flags: /'; echo
.venv/bin/python -m loadtests.bench_engine --limits --model "$model" --input-len 128 \
    --result-dir "$out" | grep '^{' 
for row in "${rows[@]}"; do
  name=$(echo "$row" | tr ' ' '_' | tr -d '-')
  log="$out/$name-serve.txt"
  # shellcheck disable=SC2086
  start_launcher "$log" --model "$model" --port "$port" --quantization $row
  .venv/bin/python -m loadtests.bench --port "$port" --model "$model" --dataset-name random \
      --input-len 128 --output-len 128 --num-prompts 8 --max-concurrency 1 --ignore-eos \
      --temperature 0 --server-pid $pid > "$out/$name-c1.txt" 2>&1
  .venv/bin/python -m loadtests.bench --port "$port" --model "$model" --dataset-name random \
      --input-len 128 --output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos \
      --temperature 0 --server-pid $pid > "$out/$name-c64.txt" 2>&1
  rss=$(ps -eo rss=,args= | awk '$2 ~ /^ray::ServeReplica:.*EngineReplica/ {s += $1; n++}
      END {printf "%.0f MB in %d replica(s)", s / 1024, n}')
  stop_launcher
  weights=$(grep -m1 -o "weights [^;]*MB" "$log" || echo "weights ?")
  field() { grep -m1 "$1" "$2" | awk '{print $NF}'; }
  printf '%s: lone stream %s tok/s, TPOT p50 %s ms, TTFT p50 %s ms; 64 streams %s tok/s; engine RSS %s; %s\n' \
      "$row" "$(field "Output token throughput" "$out/$name-c1.txt")" \
      "$(field "Median TPOT" "$out/$name-c1.txt")" "$(field "Median TTFT" "$out/$name-c1.txt")" \
      "$(field "Output token throughput" "$out/$name-c64.txt")" "$rss" "$weights"
  sleep 3
done
