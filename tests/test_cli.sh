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

if [[ $failures -ne 0 ]]; then
  echo "$failures command-line check(s) failed"
  exit 1
fi
echo "all command-line checks passed"
