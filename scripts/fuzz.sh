#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) in build-fuzz and runs each for SECONDS (default 30)
# from its seed corpus in fuzz/corpus/<target>/. New inputs go to build-fuzz/corpus/<target>/, crashes to
# build-fuzz/crashes/; a crash fails the script. Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
jobs="${JOBS:-2}"
CC="${CC:-clang}" CXX="${CXX:-clang++}" cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRANKLAB_FUZZ=ON -DRANKLAB_TESTS=OFF -DRANKLAB_BENCH=OFF -DRANKLAB_CUDA=OFF >/dev/null
targets=(profile report measurements command_line)
cmake --build build-fuzz -j"$jobs" --target "${targets[@]/#/fuzz_}"
mkdir -p build-fuzz/crashes
status=0
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t"
  echo "fuzz_$t: ${seconds} s"
  # -rss_limit_mb and -timeout: a reader that hangs or balloons on some input is a finding too.
  if ! build-fuzz/fuzz/fuzz_"$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -artifact_prefix="build-fuzz/crashes/$t-" -print_final_stats=1 \
    "build-fuzz/corpus/$t" "fuzz/corpus/$t" 2>"build-fuzz/fuzz_$t.log"; then
    echo "fuzz_$t found a failure; its input is in build-fuzz/crashes/:"
    tail -40 "build-fuzz/fuzz_$t.log"
    status=1
  fi
done
exit $status
