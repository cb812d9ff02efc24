"""Students made from the teacher: importance from a calibration pass, cuts, a Hugging Face student
(``write_pruned_hf``) or a megatron-core one (``pruned_megatron_state``)."""

from megatron_kd.prune.cuts import KeptParts, PruneError, PruneTargets, check_targets, choose_kept
from megatron_kd.prune.hf_checkpoint import write_pruned_hf
from megatron_kd.prune.importance import ImportanceCollector, ImportanceScores, calibrate
from megatron_kd.prune.megatron_state import pruned_megatron_state

__all__ = ["ImportanceCollector", "ImportanceScores", "KeptParts", "PruneError", "PruneTargets", "calibrate",
           "check_targets", "choose_kept", "pruned_megatron_state", "write_pruned_hf"]
