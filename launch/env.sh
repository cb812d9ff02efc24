# Shared by the launchers (sourced): the project's Python and the environment Megatron expects.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$( [ -x "$_root/.venv/bin/python" ] && echo "$_root/.venv/bin/python" || echo python3 )}
# the package from this checkout wherever the user stands: a recipe's relative paths (--data-path,
# --save, --kd-cache, --tensorboard-dir) resolve from the directory the command was typed in
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
GPUS=${GPUS:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
# Megatron-LM's requirement for overlapping tensor-parallel communication with compute
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# asynchronous NCCL errors end the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# the caching allocator grows mapped segments instead of keeping fixed ones: less memory stranded
# between blocks of other sizes, so NCCL's own allocations still find room near the peak
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# what torchrun sets when it is unset, without its banner saying so
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torch.compile's and Triton's caches (the compiled attention, activation and optimizer kernels)
# where a restart finds them: their defaults (/tmp/torchinductor_$USER, ~/.triton) vanish with a
# container, and a cold start recompiles for minutes. MEGATRON_KD_CACHE_HOME moves both.
_kd_cache=${MEGATRON_KD_CACHE_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_kd}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$_kd_cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$_kd_cache/triton}
# FlashAttention-4's compiled CuTe kernels (core attention's flash4 path), off by default in flash-attn-4
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$_kd_cache/flash_attn}
# torchrun (torch.distributed.run), quiet about what the ranks report themselves: when the first rank
# to fail stopped on a user mistake (exit status 2, its one line printed), torchrun's failure report
# and its "Sending process ... closing signal" notices are left out and it exits 2. Any other
# failure keeps torchrun's report; MEGATRON_KD_VERBOSE=1 or --verbose keeps everything.
read -r -d '' _TORCHRUN_PY <<'PY' || true
import logging, os, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

class Routine(logging.Filter):
    def filter(self, record):
        text = record.getMessage()
        return not ((text.startswith("Sending process ") and "closing signal" in text)
                    or text.startswith("failed (exitcode: 2)"))

verbose = os.environ.get("MEGATRON_KD_VERBOSE", "") not in ("", "0") or "--verbose" in sys.argv
if not verbose:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(Routine())
try:
    main()
except ChildFailedError as e:
    if verbose or e.get_first_failure()[1].exitcode != 2:
        raise
    sys.exit(2)
PY
TORCHRUN=("$PY" -c "$_TORCHRUN_PY")
