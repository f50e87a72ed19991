#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages ranklab builds with, when they are missing.
# Runs apt-get as root, through sudo otherwise; when neither works it prints the command to run.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ccache
  libeigen3-dev libboost-fiber-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libfmt-dev nlohmann-json3-dev libtomlplusplus-dev libgoogle-perftools-dev
  libopenmpi-dev openmpi-bin
)
# Extra packages a caller asks for (CI adds clang-format and chromium).
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "ranklab: installing missing packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo)
elif command -v sudo >/dev/null 2>&1 && [ -t 0 ]; then
  sudo=(sudo)  # asks for a password on the terminal
else
  echo "ranklab: cannot install as $(id -un) without sudo. Run this, then try again:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
