# Shared by the launchers (sourced): the project's Python and the environment Megatron expects.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$( [ -x "$_root/.venv/bin/python" ] && echo "$_root/.venv/bin/python" || echo python3 )}
GPUS=${GPUS:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
# Megatron-LM's requirement for overlapping tensor-parallel communication with compute
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# asynchronous NCCL errors end the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
