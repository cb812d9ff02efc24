"""Students made from the teacher: importance from a calibration pass, cuts, a Hugging Face student."""

from megatron_kd.prune.cuts import KeptParts, PruneError, PruneTargets, choose_kept
from megatron_kd.prune.hf_checkpoint import write_pruned_hf
from megatron_kd.prune.importance import ImportanceCollector, ImportanceScores, calibrate

__all__ = ["ImportanceCollector", "ImportanceScores", "KeptParts", "PruneError", "PruneTargets", "calibrate",
           "choose_kept", "write_pruned_hf"]
