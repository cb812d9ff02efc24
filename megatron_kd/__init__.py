"""megatron_kd: offline top-K knowledge distillation for Megatron-Core."""

from megatron_kd.version import __version__

__all__ = ["__version__"]
