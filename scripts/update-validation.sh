#!/usr/bin/env bash
# Rewrites the sweep tables of docs/validation.md from validation/: every file simulated with the model as
# it is now (`ranklab validate --write-doc`). Run after any change to the model or to validation/, then
# commit the page with the change; tests/test_validation_sweeps.cc fails until the two agree.
#
#   scripts/update-validation.sh [BUILD_DIR]     (default: build, configured and built as in README.md)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
cmake --build "$build" --target ranklab -j2
"$build/tools/ranklab" validate "$root/validation" --write-doc "$root/docs/validation.md"
