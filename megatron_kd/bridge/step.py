"""The forward step of an offline-KD run under Bridge's ``pretrain`` / ``finetune``.

``BridgeKDForwardStep`` is a Bridge forward step (``(state, data_iterator, model,
return_schedule_plan)``: Bridge hands it its ``GlobalState``) and a Bridge callback; ``pretrain`` /
``finetune`` here pass it as both, which is all a recipe needs besides its ``kd`` block
(``config.with_kd``):

- ``on_train_start`` (every rank, before the first step): Bridge's train split built again by Bridge
  (``data.bridge_train_split``: a collective, hence here and not in a forward step, where pipeline
  stages wait on each other) and, on the ranks that read teacher rows (tensor-parallel rank 0 of the
  last pipeline stage), joined to ``state.cfg.kd.cache`` (``data.TeacherRows``): one line and no step
  when the cache lacks a sample the run trains on;
- ``__call__``: megatron_kd's ``KDForwardStep`` for the model chunk's pipeline stage (one per virtual
  stage), its process groups the model's (Bridge's ``pg_collection``), its packing ``cfg.dataset``'s,
  reading training micro-batches through ``data.WithTeacherRows``: the loss is the fused top-K KL of
  ``megatron-kd train``, taken through GPTModel's ``output_processor``. Evaluation batches (the model
  in eval mode) carry no teacher: the student's cross-entropy, as in ``megatron-kd train``.

Bridge's own schedule, optimizer, checkpointing and logging run unchanged; the reported losses are
``KDForwardStep``'s (lm loss, kd loss, ce loss, teacher mass, teacher entries).
"""

from __future__ import annotations

from megatron_kd.bridge.compat import BridgeError
from megatron_kd.bridge.config import KDConfigContainer
from megatron_kd.bridge.data import TeacherRows, WithTeacherRows, bridge_train_split, document_packing
from megatron_kd.megatron.args import KDConfig
from megatron_kd.megatron.loss import KDForwardStep


def kd_config(cfg) -> KDConfig:
    if not isinstance(cfg, KDConfigContainer):
        raise BridgeError(f"the run's config is a {type(cfg).__name__} without a kd block: give the recipe one with "
                          f"megatron_kd.bridge.with_kd(cfg, KDConfig(cache=PATH))")
    return cfg.kd


def _stages(cfg, model) -> tuple[int | None, bool, bool]:
    """(virtual stage, first, last) of the model chunk ``model``, as Bridge's own step finds them."""
    from megatron.bridge.training.utils.flop_utils import get_model_chunk_vp_stage
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage, is_vp_first_stage,
                                                       is_vp_last_stage)

    pp = get_pg_collection(model).pp
    vp_stage, vp_size = get_model_chunk_vp_stage(model), cfg.model.virtual_pipeline_model_parallel_size
    first = is_pp_first_stage(pp) and (vp_stage is None or is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size))
    last = is_pp_last_stage(pp) and (vp_stage is None or is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size))
    return vp_stage, first, last


class BridgeKDForwardStep:
    """Bridge forward step and callback of an offline-KD run (module docstring)."""

    def __init__(self):
        self.rows: TeacherRows | None = None  # on the ranks that read teacher rows, once training starts
        self.started = False
        self._steps: dict[int | None, KDForwardStep] = {}

    def on_train_start(self, context) -> None:
        from megatron.bridge.training.utils.pg_utils import get_pg_collection
        from megatron.core.pipeline_parallel.utils import is_pp_last_stage

        cfg = context.state.cfg
        kd = kd_config(cfg)
        train, required = bridge_train_split(cfg)
        pg = get_pg_collection(context.model)
        if pg.tp.rank() == 0 and is_pp_last_stage(pg.pp):
            self.rows = TeacherRows(train, kd.cache, tokenizer=cfg.dataset.tokenizer, required_samples=required,
                                    packing=document_packing(cfg))
            meta, dataset = self.rows.dataset.meta, self.rows.dataset
            if pg.dp.rank() == 0:
                print(f"> distilling from {kd.cache}: K={meta.topk}, mode={meta.mode}, {meta.num_samples} samples; the "
                      f"run's {len(dataset.rows)} found by their tokens in {dataset.match_seconds:.1f} s "
                      f"({dataset.relocated} at another index than their own)", flush=True)
                if kd.divergence_warning:
                    print(kd.divergence_warning, flush=True)
        self.started = True

    def _step(self, cfg, model) -> KDForwardStep:
        from megatron.bridge.training.utils.pg_utils import get_pg_collection

        vp_stage, first, last = _stages(cfg, model)
        if vp_stage not in self._steps:
            pg = get_pg_collection(model)
            self._steps[vp_stage] = KDForwardStep(
                kd_config(cfg), tp_group=pg.tp, cp_group=pg.cp if pg.cp.size() > 1 else None,
                is_first_stage=lambda: first, is_last_stage=lambda: last, packing=document_packing(cfg))
        return self._steps[vp_stage]

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        if return_schedule_plan:
            raise BridgeError("model.overlap_moe_expert_parallel_comm asks the forward step for a schedule plan; the "
                              "KD loss runs through GPTModel's output_processor, which a schedule plan does not call: "
                              "set it to False")
        step = self._step(state.cfg, model)
        if model.training:
            if not self.started:
                raise BridgeError("BridgeKDForwardStep joins Bridge's training samples to the cache when training "
                                  "starts: pass it as a callback too, pretrain(cfg, step, callbacks=[step]) (or use "
                                  "megatron_kd.bridge.pretrain(cfg))")
            if self.rows is not None and step.is_last_stage():
                data_iterator = WithTeacherRows(self.rows, data_iterator)
        return step(data_iterator, model)


def pretrain(cfg: KDConfigContainer) -> None:
    """Bridge's ``pretrain`` of ``cfg`` (a recipe ``with_kd``) with the KD forward step."""
    from megatron.bridge.training.pretrain import pretrain as bridge_pretrain

    kd_config(cfg)
    step = BridgeKDForwardStep()
    bridge_pretrain(cfg, step, callbacks=[step])


def finetune(cfg: KDConfigContainer) -> None:
    """Bridge's ``finetune`` (from ``cfg.checkpoint.pretrained_checkpoint``) with the KD forward step."""
    from megatron.bridge.training.finetune import finetune as bridge_finetune

    kd_config(cfg)
    step = BridgeKDForwardStep()
    bridge_finetune(cfg, step, callbacks=[step])
