#!/bin/sh
# `ranklab plan` spread over an MPI job against the same number of simulations at once in one process: the
# cost of the engine (messages, a polling rank 0) on one machine. Prints each one's wall time and checks
# that the two plans are the same (docs/lessons/plan.md, "A plan across a cluster").
#
#   bench/plan_cluster.sh [build dir] [ranklab plan flags...]    default: the 70B question, torchtitan
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- --model llama3-70b --profile dgx-h100 --nodes 64 --global-batch 1024 --framework torchtitan
ranklab=$build/tools/ranklab
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=""
mpirun --version 2>/dev/null | grep -q "Open MPI" && flags="--allow-run-as-root --oversubscribe"
start=$(date +%s.%N)
"$ranklab" plan "$@" --jobs 2 --report "$out/one" > "$out/one.log"
middle=$(date +%s.%N)
# shellcheck disable=SC2086
mpirun $flags -n 2 "$ranklab" plan "$@" --jobs 1 --report "$out/two" > "$out/two.log"
end=$(date +%s.%N)
python3 -c "print('one process, --jobs 2: %.1f s' % ($middle - $start))"
python3 -c "print('mpirun -n 2, --jobs 1: %.1f s' % ($end - $middle))"
python3 - "$out/one/plan.json" "$out/two/plan.json" <<'PY'
import json, sys
def same(path):
    j = json.load(open(path))
    for k in ("wall_s", "jobs", "processes"):
        j.pop(k, None)
    for c in j["candidates"]:
        c.pop("simulation_wall_s", None)
    return j
print("plans equal:", same(sys.argv[1]) == same(sys.argv[2]))
PY
