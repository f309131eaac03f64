#!/usr/bin/env bash
# Regenerates every committed run under tests/data/real_traces/ (see README.md beside this file).
# Usage: tools/real_traces/make_all.sh [RUN ...]   (default: all runs)
# Needs a venv with torch 2.13.0 (CPU): TORCHENV=/work/torchenv by default.
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCHRUN="${TORCHENV:-/work/torchenv}/bin/torchrun"
OUT=tests/data/real_traces

declare -A ARGS=(
  [pp2dp2-1f1b]="--schedule 1f1b --microbatches 4 --seed 0"
  [pp2dp2-1f1b-slow]="--schedule 1f1b --microbatches 4 --seed 0 --slow-rank 1 --slow-factor 6 --slow-mode compute"
  [pp2dp2-1f1b-slow-sleep]="--schedule 1f1b --microbatches 4 --seed 0 --slow-rank 1 --slow-mode sleep --slow-sleep-ms 40"
  [pp2dp2-gpipe]="--schedule gpipe --microbatches 4 --seed 0"
  [pp2dp2-interleaved]="--schedule interleaved --microbatches 4 --seed 0"
  [dp4-ddp]="--schedule dp --microbatches 2 --microbatch-size 256 --seed 0"
)
ORDER=(pp2dp2-1f1b pp2dp2-1f1b-slow pp2dp2-1f1b-slow-sleep pp2dp2-gpipe pp2dp2-interleaved dp4-ddp)
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=("${ORDER[@]}")

# Wait (at most 10 min) until other processes use less than half a core: 4 ranks on 2 cores are
# noisy enough without a concurrent test suite or benchmark.
wait_quiet() {
  python3 - <<'PY'
import time
def busy():
    def snap():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(v), v[3] + v[4]
    t0, i0 = snap(); time.sleep(3); t1, i1 = snap()
    return 1 - (i1 - i0) / max(1, t1 - t0)
deadline = time.time() + 600
while True:
    b = busy()
    if b < 0.25 or time.time() > deadline:
        print(f"machine busy {b:.0%} of 2 cores before the run")
        break
    time.sleep(20)
PY
}

for run in "${RUNS[@]}"; do
  args="${ARGS[$run]:?unknown run $run}"
  dir="$OUT/$run"
  rm -rf "$dir"
  mkdir -p "$dir"
  wait_quiet
  echo "== $run: torchrun --standalone --nproc_per_node 4 tools/real_traces/train.py $args --name $run --out $dir"
  # shellcheck disable=SC2086
  "$TORCHRUN" --standalone --nproc_per_node 4 tools/real_traces/train.py $args --name "$run" --out "$dir" \
    > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  grep '^rank' "$dir.log" | tail -2
  rm -f "$dir.log"
  gzip -9 -n "$dir"/rank-*.json
  ls -l "$dir"
done
