"""The teacher pass: run a teacher once over the training data and write its top-K cache."""

from megatron_kd.teacher.capture import CaptureConfig, capture_teacher
from megatron_kd.teacher.sources import HFTeacher, MegatronTeacher

__all__ = ["CaptureConfig", "HFTeacher", "MegatronTeacher", "capture_teacher"]
