#!/usr/bin/env bash
# Transformer Engine for megatron-core's TE spec, where the base image lacks it (NGC's PyTorch
# image has it: nothing to do there).
#
#   bash launch/install_te.sh [--wheels DIR] [--target DIR] [--version V]
#
# TE comes in three parts: transformer_engine (Python), transformer_engine_cu13 (the prebuilt
# libtransformer_engine.so) and transformer_engine_torch (a torch extension, shipped as an sdist
# and built against the installed torch: 33 C++ files, about 75 s on 16 cores).
#   --wheels DIR  install from DIR, without network: the two wheels, and either a
#                 transformer_engine_torch wheel built for this torch or its sdist (built here)
#   (no --wheels) download the parts from the package index first
#   --target DIR  install into DIR (then export PYTHONPATH=DIR:$PYTHONPATH), else into this Python
# All three go in one `pip install` (they share the transformer_engine/ folder, which a second
# --target install would skip or replace). Ends by importing transformer_engine.pytorch and running
# a te.Linear forward and backward on the GPU; prints the time each step took.
set -euo pipefail
V=2.20.2
WHEELS=""
TARGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    --version) V=$2; shift 2 ;;
    *) echo "install_te.sh: unknown argument $1 (--wheels DIR, --target DIR, --version V)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
start=$(date +%s)
step() { echo "install_te: $1 ($(( $(date +%s) - start )) s)"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$WHEELS" ]; then
  WHEELS=$work/download
  "$PY" -m pip download -q --no-deps -d "$WHEELS" "transformer_engine==$V" "transformer_engine_cu13==$V"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WHEELS" "transformer_engine_torch==$V"
  step "downloaded transformer-engine $V"
fi
py_wheel=$(ls "$WHEELS"/transformer_engine-"$V"-py3-none-any.whl)
core_wheel=$(ls "$WHEELS"/transformer_engine_cu13-"$V"-*.whl)
abi=$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
torch_wheel=$(ls "$WHEELS"/transformer_engine_torch-"$V"-"$abi"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$torch_wheel" ]; then
  sdist=$(ls "$WHEELS"/transformer_engine_torch-"$V".tar.gz)
  # the CUDA toolkit lacks cudnn.h and nccl.h: take them from the pip packages torch depends on;
  # NVTE_PYTORCH_FORCE_BUILD keeps setup.py from looking for a prebuilt extension online
  includes=$("$PY" - <<'EOF'
import importlib, os
dirs = []
for name in ("nvidia.cudnn", "nvidia.nccl"):
    try:
        module = importlib.import_module(name)
    except ImportError:
        continue
    for root in module.__path__:
        if os.path.isdir(os.path.join(root, "include")):
            dirs.append(os.path.join(root, "include"))
print(":".join(dirs))
EOF
)
  CPLUS_INCLUDE_PATH="$includes${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" NVTE_PYTORCH_FORCE_BUILD=TRUE \
    NVTE_WITH_NCCL_EP=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$work" "$sdist"
  torch_wheel=$(ls "$work"/transformer_engine_torch-"$V"-*.whl)
  step "built $(basename "$torch_wheel") against torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir ${TARGET:+--target "$TARGET"} \
  "$core_wheel" "$py_wheel" "$torch_wheel"
step "installed ${TARGET:+into $TARGET}"
PYTHONPATH="${TARGET:+$TARGET:}${PYTHONPATH:-}" "$PY" - <<'EOF'
import warnings

warnings.simplefilter("ignore")
import torch
import transformer_engine
import transformer_engine.pytorch as te

layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
layer(x).float().square().mean().backward()
torch.cuda.synchronize()
print(f"install_te: transformer_engine {transformer_engine.__version__} runs on {torch.cuda.get_device_name()}")
EOF
step "checked"
