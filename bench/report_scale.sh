#!/bin/sh
# What --report costs at scale: each run's wall time and peak RSS without and with it, and the sizes of the
# files it writes (docs/performance.md, "Reports at scale").
#
#   bench/report_scale.sh [build dir]
set -eu
build=${1:-build}
ranklab=$build/tools/ranklab
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {
  name=$1
  shift
  /usr/bin/time -f "%e %M" -o "$out/plain.time" "$ranklab" run gpt "$@" --quiet > /dev/null
  /usr/bin/time -f "%e %M" -o "$out/report.time" "$ranklab" run gpt "$@" --quiet --report "$out/$name" > /dev/null
  read -r plain_s plain_kb < "$out/plain.time"
  read -r report_s report_kb < "$out/report.time"
  size() { python3 -c "import os; print('%.1f' % (os.path.getsize('$out/$name/$1') / 1e6))"; }
  echo "$name | $plain_s s, $((plain_kb / 1024)) MiB | $report_s s, $((report_kb / 1024)) MiB |" \
    "$(size report.json) | $(size trace.perfetto-trace) | $(size report.html) MB"
}
echo "run | without --report | with --report | report.json MB | trace MB | report.html MB"
run 175b-64 --model gpt3-175b --profile dgx-a100 --nodes 8 --world 64 --tp 8 --pp 8 --interleave 2 --zero 1 \
  --seq-parallel --micro-batch 1 --global-batch 64 --phantom --steps 1
run 1t-512 --model megatron-1t --profile dgx-a100 --nodes 64 --world 512 --tp 8 --pp 64 --zero 1 --seq-parallel \
  --micro-batch 1 --global-batch 64 --phantom --steps 1
run 175b-4096 --model gpt3-175b --profile dgx-a100 --nodes 512 --world 4096 --tp 8 --pp 8 --zero 1 \
  --seq-parallel --micro-batch 1 --global-batch 512 --phantom --steps 1 --symmetric
run 405b-16384 --model llama3.1-405b --profile dgx-h100 --nodes 2048 --world 16384 --tp 8 --pp 16 \
  --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7 --zero 1 --recompute full \
  --global-batch 2048 --micro-batch 1 --phantom --steps 1 --framework megatron-core --symmetric
