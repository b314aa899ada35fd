# Sourced by the serving scripts: `make serve`'s launcher in the background.
#   start_launcher LOG ARGS...   starts `python -m cluster.serve_local ARGS...`, output in LOG,
#                                sets $pid and returns once it prints "Serving at" (exits 1,
#                                printing LOG, if it ends first); Ctrl-C or an exit stops it
#   stop_launcher                stops it as Ctrl-C would and waits for it

start_launcher() {
  local log=$1
  shift
  .venv/bin/python -m cluster.serve_local "$@" > "$log" 2>&1 &
  pid=$!
  trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 900); do
    grep -q "^Serving at" "$log" && return 0
    kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.2
  done
  echo "no \"Serving at\" in $log after 180 s" >&2
  exit 1
}

stop_launcher() {
  kill -INT $pid
  wait $pid 2>/dev/null || true
  trap - EXIT
}
