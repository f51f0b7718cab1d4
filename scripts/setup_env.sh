#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs mjax with its test extras.
# Re-runs the install only when pyproject.toml changed since the last successful one.
set -euo pipefail
cd "$(dirname "$0")/.."

is_ok() {  # is_ok CMD: CMD runs and is Python >= 3.12
  "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  if [ -n "${MJAX_PYTHON:-}" ]; then
    is_ok "$MJAX_PYTHON" && { echo "$MJAX_PYTHON"; return; }
    echo "MJAX_PYTHON=$MJAX_PYTHON is not a working Python >= 3.12" >&2; exit 1
  fi
  for c in python3.14 python3.13 python3.12 python3; do
    command -v "$c" >/dev/null 2>&1 && is_ok "$c" && { command -v "$c"; return; }
  done
  # pyenv shims answer only with PYENV_VERSION set: use pyenv's installed interpreters directly.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for p in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -rV); do
    is_ok "$p/bin/python3" && { echo "$p/bin/python3"; return; }
  done
  echo "No Python >= 3.12 found (tried python3.14..python3.12, python3, and $root/versions)." >&2
  echo "Install Python 3.12 or newer, or point MJAX_PYTHON at one." >&2
  exit 1
}

if [ ! -x .venv/bin/python ] || ! is_ok .venv/bin/python; then
  py=$(find_python)
  echo "setup: creating .venv with $py ($("$py" --version 2>&1))"
  rm -rf .venv
  "$py" -m venv .venv
fi

stamp=.setup-stamp
extras="test"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then extras="test,cuda13"; fi
# The extras are part of the stamp: a .venv set up without a GPU (CPU jax) is redone on a machine with one.
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing mjax and its dependencies ($extras) into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi
