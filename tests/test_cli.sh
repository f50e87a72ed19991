#!/usr/bin/env bash
# The command line's answers to wrong or doubtful input: each must end with the right exit status and a
# message that says what was wrong. Usage: test_cli.sh RANKLAB_BINARY
set -u
ranklab="$1"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0

# expect STATUS SUBSTRING ARGS...: runs ranklab ARGS, wants exit status STATUS and SUBSTRING in its output.
expect() {
  local status="$1" want="$2"
  shift 2
  local out rc
  out="$(timeout 120 "$ranklab" "$@" 2>&1)"
  rc=$?
  if [[ $rc -ne $status || "$out" != *"$want"* ]]; then
    echo "FAILED: ranklab $* -> exit $rc (wanted $status), output wanted to contain: $want"
    echo "$out" | tail -5 | sed 's/^/    /'
    failures=$((failures + 1))
  fi
}

profile_dir="$(dirname "$0")/../profiles"
sed 's/^gpus_per_node = 8/gpus_per_node = 8\nnodes = 2/' "$profile_dir/dgx-h100.toml" >"$tmp/two.toml"
line="$(grep -n '^nodes = 2' "$tmp/two.toml" | cut -d: -f1)"

# Nodes: the profile's and the command line's must agree, and the world must use them.
expect 1 "--nodes 1 contradicts the profile's 'nodes = 2' ($tmp/two.toml:$line)" run collectives --profile "$tmp/two.toml" --nodes 1
expect 1 "--world 4 fills only 1: give --world 9 to 16" run collectives --profile "$tmp/two.toml"
expect 1 "--world 4 fills only 1: give --world 9 to 16 to use 2 nodes, or drop --nodes" run collectives --nodes 2
expect 0 "all_reduce" run benchmark --profile "$tmp/two.toml" --world 16 --count 1024 --quiet

# Options that were accepted although they mean nothing, or silently changed: each value is checked against
# its lesson's declaration, and a flag must be one of the lesson's.
expect 1 "collectives: --world must be at least 1 (got 0)" run collectives --world 0
for bad in 0 -1 nan inf 1e400; do
  expect 1 "data_parallel: --bucket-mb must be a finite number above 0 and at most 1048576 (got $bad)" run data_parallel --bucket-mb "$bad"
done
expect 1 "data_parallel: --lr must be a finite number above 0 (got inf)" run data_parallel --lr inf
expect 1 "gpt: --hidden must be at least 1 and at most 2147483647 (got 4294967360)" run gpt --hidden 4294967360
expect 1 "gpt: --world 4 is not divisible by --tp 65536 x --pp 65536 = 4294967296" run gpt --world 4 --tp 65536 --pp 65536
expect 1 "--overlap is not an option of lesson gpt (\`ranklab run gpt --help\` lists its options)" run gpt --overlap
expect 1 "zero: --break must be sum or no-all-gather (got 'sp')" run zero --break sp
expect 1 "--count 4611686018427387904: 4 ranks x 4611686018427387904 float32 is more bytes" run benchmark --count 4611686018427387904
expect 1 "benchmark: --op must be all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, scatter or gather (got 'foo')" run benchmark --op foo
expect 1 "--op broadcast needs --sweep" run benchmark --op broadcast
expect 0 "--count 10 is not a multiple of the 4 ranks (reduce_scatter gives each the same share): timing 8 float32" run benchmark --count 10
expect 1 "--count has no effect with --sweep" run benchmark --sweep --count 10
expect 0 "ranklab " --version

# Where the output goes.
expect 1 "--report /proc/x: cannot create the folder" run collectives --report /proc/x
expect 0 "report written to $tmp/out/" run collectives --quiet --report "$tmp/out//"
# A run that fails leaves no folder behind; a file ranklab did not write is replaced only with --force, and
# a folder of ranklab's own files is written over.
expect 1 "--world 4 is not divisible by --tp 3" run gpt --report "$tmp/failed/deep" --tp 3
if [[ -e "$tmp/failed" ]]; then
  echo "FAILED: a run that failed left $tmp/failed behind"
  failures=$((failures + 1))
fi
mkdir -p "$tmp/theirs" && echo '{"mine": true}' >"$tmp/theirs/report.json"
expect 1 "--report $tmp/theirs: $tmp/theirs/report.json is not a file ranklab wrote; give --force" run collectives --quiet --report "$tmp/theirs"
if [[ "$(cat "$tmp/theirs/report.json")" != '{"mine": true}' ]]; then
  echo "FAILED: a refused --report replaced $tmp/theirs/report.json"
  failures=$((failures + 1))
fi
expect 0 "report written to $tmp/theirs/" run collectives --quiet --report "$tmp/theirs" --force
expect 0 "report written to $tmp/theirs/" run collectives --quiet --report "$tmp/theirs"
# The trace: Perfetto's format unless asked otherwise (the second run above wrote over the first's), of the
# ranks asked for.
for f in summary.txt report.json trace.perfetto-trace report.html; do
  [[ -s "$tmp/theirs/$f" ]] || { echo "FAILED: --report wrote no $f"; failures=$((failures + 1)); }
done
expect 0 "report written to $tmp/json/" run collectives --quiet --report "$tmp/json" --trace-format json --trace-ranks 1,3
if ! grep -q '"pid":3' "$tmp/json/trace.json" || grep -q '"pid":2' "$tmp/json/trace.json"; then
  echo "FAILED: --trace-ranks 1,3 did not trace ranks 1 and 3 only"
  failures=$((failures + 1))
fi
expect 1 "--trace-ranks: rank 4 is not one of the run's 4 ranks (0 to 3)" run collectives --trace-ranks 0,4
expect 1 "--trace-ranks 2-x: 'x' is not a rank" run collectives --trace-ranks 2-x
expect 1 "--trace-format" run collectives --trace-format xml
touch "$tmp/afile"
expect 1 "--report $tmp/afile: that is a file, not a folder" run collectives --report "$tmp/afile"

# A report that does not read says which file and which value, and never truncates an integer.
sed 's/"world":4,/"world":4294967300,/' "$tmp/out/report.json" >"$tmp/wide.json"
expect 1 "$tmp/wide.json: world: expected an integer from -2147483648 to 2147483647, got 4294967300" compare "$tmp/wide.json"
sed 's/"peak_bytes":[0-9]*/"peak_bytes":"1 GiB"/2' "$tmp/out/report.json" >"$tmp/text.json"
expect 1 "$tmp/text.json: ranks[1].peak_bytes: expected an integer, got a string (\"1 GiB\")" compare "$tmp/text.json"
if [[ -w /dev/full ]]; then
  out="$("$ranklab" run collectives --quiet 2>&1 >/dev/full)"
  rc=$?
  if [[ $rc -ne 1 || "$out" != *"cannot write the output"* ]]; then
    echo "FAILED: output to a full device exits $rc: $out"
    failures=$((failures + 1))
  fi
fi

# The gpt lesson's shape and layout flags reach the lesson, and a preset fills only what was not given.
expect 0 "layout: tp 2 x pp 2 x dp 2, zero 1, recompute full" run gpt --world 8 --tp 2 --pp 2 --zero 1 --recompute full --global-batch 8 --micro-batch 1 --steps 1
expect 0 "gpt llama3-70b: llama block, 3 layers, hidden 8192, 64 heads (8 key-value), SwiGLU 28672, seq 8192, vocab 128256" run gpt --model llama3-70b --layers 3 --world 8 --tp 8 --global-batch 1 --micro-batch 1 --steps 1 --phantom
expect 1 "--model: no preset called 'gpt5'; the presets are: gpt3-125m" run gpt --model gpt5
expect 0 "symmetric run: 2 of 8 ranks ran, the others mirrored them" run gpt --world 8 --tp 2 --pp 2 --global-batch 8 --micro-batch 1 --steps 1 --phantom --symmetric
expect 0 "symmetric run: 4 of 8 ranks ran, the others mirrored them" run gpt --world 8 --tp 2 --pp 2 --global-batch 8 --micro-batch 1 --steps 1 --phantom --symmetric=tp
expect 1 "--symmetric must be tp or tp-dp (got 'tp-tp')" run gpt --world 8 --tp 2 --phantom --symmetric=tp-tp
expect 1 "--symmetric is a setting of the simulator's model" run gpt --backend cuda --phantom --symmetric

# validate: a folder without sweeps, and a sweep without its "# ranklab:" line, are named.
mkdir -p "$tmp/sweeps"
expect 1 "$tmp/sweeps: no measurement (*.log, *.csv) to validate" validate "$tmp/sweeps"
grep -v '^# ranklab:' "$(dirname "$0")/../validation/h100x8-all_reduce-dgxc-benchmarking.log" >"$tmp/sweeps/h100.log"
expect 1 "$tmp/sweeps/h100.log: no '# ranklab: --profile P [--nodes N]' line" validate "$tmp/sweeps"

# Calibrate on nccl-tests output: before and after in compare's figure, and a fitted profile that runs.
{
  echo "# nThread 1 nGpus 8 minBytes 8 maxBytes 1073741824 step: 512(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0"
  echo "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
  echo "           8             2     float     sum      -1    30.00    0.00    0.00      0    30.00    0.00    0.00      0"
  echo "        4096          1024     float     sum      -1    33.00    0.12    0.22      0    33.00    0.12    0.22      0"
  echo "     2097152        524288     float     sum      -1    95.00   22.08   38.63      0    95.00   22.08   38.63      0"
  echo "  1073741824     268435456     float     sum      -1 16500.00   65.08  113.88      0 16500.00   65.08  113.88      0"
} >"$tmp/all_reduce_perf.log"
expect 0 "compare's geometric-mean error (collectives and regions)" calibrate "$tmp/all_reduce_perf.log" --profile dgx-a100 -o "$tmp/lab.toml"
expect 0 "fitted profile written to $tmp/lab.toml" calibrate "$tmp/all_reduce_perf.log" --profile dgx-a100 -o "$tmp/lab.toml"
expect 0 "geometric-mean error" compare "$tmp/all_reduce_perf.log" --profile "$tmp/lab.toml" --html ""
expect 0 "(lab, 1 node)" run collectives --profile "$tmp/lab.toml" --quiet

# plan: a question it cannot answer says why, before simulating anything; a small one answers.
expect 1 "plan: --top must be at least 1 (got 0)" plan --top 0
expect 1 "--model: no preset called 'gpt5'; the presets are: gpt3-125m" plan --model gpt5
expect 1 "layouts of 8 ranks for this question; the first, tp1-pp1-v1-dp8-zero0-mb1-none-tp-dp-pp, because gpt: --global-batch 3 is not divisible" plan --layers 2 --heads 2 --global-batch 3
expect 1 "--explain 'tp9': too few parts" plan --explain tp9
expect 1 "the gpt lesson refuses it: gpt: --heads 4 is not divisible by --tp 8" plan --explain tp8-pp1-v1-dp1-zero0-mb1-none-tp-dp-pp
expect 1 "--report /proc/x: cannot create the folder" plan --report /proc/x
expect 1 "plan: --jobs 100000 is more than this machine's" plan --jobs 100000
expect 0 "report written to $tmp/plan/ (plan.json, plan.html)" plan --layers 2 --global-batch 8 --top 3 --max-candidates 20 --report "$tmp/plan"
echo 'notes' >"$tmp/plan/plan.html"
expect 1 "$tmp/plan/plan.html is not a file ranklab wrote" plan --layers 2 --global-batch 8 --top 3 --max-candidates 20 --report "$tmp/plan"
expect 0 "explain tp2-pp1-v1-dp4-zero1-mb2-none-tp-dp-pp:" plan --layers 2 --global-batch 8 --max-candidates 5 --explain tp2-pp1-v1-dp4-zero1-mb2-none-tp-dp-pp

# A command never writes over a file it reads: the measurement, or the profile it starts from.
log="$(dirname "$0")/../validation/h100x8-all_reduce-nccl-tests-290.log"
cp "$log" "$tmp/in.log"
expect 1 "-o $tmp/in.log: that is a file this command reads" calibrate "$tmp/in.log" -o "$tmp/in.log"
expect 1 "that is a file this command reads" calibrate "$tmp/in.log" -o "$profile_dir/dgx-h100.toml"
expect 1 "--html $tmp/./in.log: that is a file this command reads" compare "$tmp/in.log" --html "$tmp/./in.log"
echo '<p>my notes</p>' >"$tmp/notes.html"
expect 1 "--html $tmp/notes.html: that is not a page ranklab wrote; give --force" compare "$tmp/in.log" --html "$tmp/notes.html"
expect 0 "comparison written to $tmp/notes.html" compare "$tmp/in.log" --html "$tmp/notes.html" --force
expect 0 "comparison written to $tmp/notes.html" compare "$tmp/in.log" --html "$tmp/notes.html"
if ! cmp -s "$log" "$tmp/in.log"; then
  echo "FAILED: a refused command changed its input $tmp/in.log"
  failures=$((failures + 1))
fi

# One simulated world per job, not one per process of a launcher.
OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0 expect 1 "the simulator (--backend sim) simulates the whole world in one process" run collectives

if [[ $failures -ne 0 ]]; then
  echo "$failures command-line check(s) failed"
  exit 1
fi
echo "all command-line checks passed"
