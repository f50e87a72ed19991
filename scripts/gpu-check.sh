#!/usr/bin/env bash
# The real backend's check on a GPU machine, in one command:
#   1. builds ranklab with the CUDA backend (RANKLAB_CUDA=ON, so a missing nvcc or NCCL fails loudly);
#   2. runs every test (the GPU tests run one at a time, so their timings do not share the device);
#   3. runs every lesson on the GPUs at the largest world this machine allows, and on the simulator with
#      the profile matching the GPU, and writes both reports as JSON;
#   4. runs the GPT lesson in FP8 on the GPUs, each recipe a Hopper GPU has;
#   5. runs the benchmark sweep on the GPUs with --report and compares it with the simulator
#      (`ranklab compare`: the same lesson simulated with the GPU's profile), text and compare.html.
#
#   scripts/gpu-check.sh OUT_DIR [BUILD_DIR]
#
# OUT_DIR receives tests.log, lessons.log, cuda.json and sim.json (one report per lesson, keyed by its
# name), summary.txt (one line per lesson: status and makespan on each backend), cli.log (the command
# line's own `--backend cuda` run) and fp8.log (the GPT lesson in FP8, per-tensor and blockwise). Needs no
# network. JOBS sets the build's parallelism (default 16).
set -uo pipefail

out=${1:?usage: scripts/gpu-check.sh OUT_DIR [BUILD_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${2:-$root/build-gpu}
jobs=${JOBS:-16}
mkdir -p "$out"
out=$(cd "$out" && pwd)
status=0

step() { printf '\n== %s\n' "$*"; }

step "GPUs"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
else
  echo "nvidia-smi not found; the CUDA runtime decides below"
fi

step "configure and build ($build, -j$jobs)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRANKLAB_CUDA=ON -DRANKLAB_BENCH=OFF || exit 1
cmake --build "$build" -j"$jobs" || exit 1

step "tests"
(
  cd "$build" || exit 1
  rc=0
  # CPU tests in parallel, then the GPU ones alone.
  ctest --output-on-failure -j"$jobs" -E '^CudaBackend' || rc=1
  ctest --output-on-failure -j1 -R '^CudaBackend' || rc=1
  exit $rc
) 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: TESTS FAILED"; status=1; }

step "every lesson on the GPUs and on the simulator"
"$build/tools/ranklab_gpu_check" "$out" 2>&1 | tee "$out/lessons.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: LESSONS FAILED"; status=1; }

step "the command line on the GPUs"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
"$build/tools/ranklab" run collectives --backend cuda --world "$gpus" 2>&1 | tee "$out/cli.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: THE COMMAND LINE'S CUDA RUN FAILED"; status=1; }

step "the GPT lesson in FP8 on the GPUs (it checks itself against one device)"
for recipe in current delayed blockwise; do
  "$build/tools/ranklab" run gpt --backend cuda --world "$gpus" --fp8-recipe "$recipe" 2>&1 |
    tee -a "$out/fp8.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: THE GPT LESSON IN FP8 ($recipe) FAILED"; status=1; }
done

step "the benchmark sweep on the GPUs, compared with the simulator"
mkdir -p "$out/sweep"
"$build/tools/ranklab" run benchmark --backend cuda --world "$gpus" --sweep --quiet --report "$out/sweep" \
  2>&1 | tee "$out/sweep.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: THE SWEEP FAILED"; status=1; }
(cd "$out" && "$build/tools/ranklab" compare sweep/report.json --html compare-sweep.html) 2>&1 |
  tee "$out/compare-sweep.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: COMPARE FAILED"; status=1; }

step "result"
cat "$out/summary.txt" 2>/dev/null
if [ "$status" -eq 0 ]; then
  echo "gpu-check: all passed; reports in $out"
else
  echo "gpu-check: FAILED (see above)"
fi
exit "$status"
