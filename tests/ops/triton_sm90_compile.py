"""Compile the project's Triton kernels for Hopper (sm_90) without a GPU: Triton's front end and
ptxas run on the CPU, so CI catches kernels that the interpreter accepts but the compiler does not
(e.g. a non-constexpr global). Run as a script with TRITON_INTERPRET unset; prints one line per kernel.
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_kd.ops.kl.chunk_triton import (
    ENTRY_TILE,
    ROW_TERMS_BLOCK,
    ROW_TERMS_SUPPORT_BLOCK,
    SUMS_INLINE,
    SUMS_LOADED,
    SUMS_NONE,
    SUMS_PARTIAL,
    exp_stats_kernel,
    grad_fixup_kernel,
    row_terms_kernel,
    scale_rows_kernel,
)
from megatron_kd.ops.teacher import sample_triton as st
from megatron_kd.ops.teacher.sample import SAMPLE_TILE
from megatron_kd.ops.teacher.topk_triton import topk_candidates_kernel
from megatron_kd.models.moe_permutation import BLOCK_H, _gather_sum_kernel
from megatron_kd.models.rope import _rope_kernel
from megatron_kd.optim.adam_triton import BLOCKS, ITEM_BLOCKS, NUM_WARPS, bf16_adam_kernel

GPT_OSS_VOCAB = 201_088


def compile_sm90(fn, types: dict, constexprs: dict, num_warps: int):
    signature = {**types, **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    print(f"{fn.__name__}: {len(kernel.asm['ptx'])} bytes of PTX")


def main():
    compile_sm90(
        topk_candidates_kernel,
        {"z_ptr": "*fp32", "z_stride": "i64", "max_ptr": "*fp32", "sumexp_ptr": "*fp32",
         "cand_val_ptr": "*fp32", "cand_col_ptr": "*i32"},
        {"V": GPT_OSS_VOCAB, "K": 100, "GROUPS": 256, "CAP": 1024, "BLOCK_V": 4096}, num_warps=16,
    )
    # the sampler's passes at one rank of an 8-GPU node's vocabulary shard (201,088 / 8)
    shard = GPT_OSS_VOCAB // 8
    tiles = -(-shard // SAMPLE_TILE)
    compile_sm90(st.tile_stats_kernel, {"z_ptr": "*fp32", "z_stride": "i64", "max_ptr": "*fp32", "sumexp_ptr": "*fp32"},
                 {"V": shard, "NUM_TILES": tiles, "TILE": SAMPLE_TILE, "TILES_PER_PROGRAM": st.TILES_PER_PROGRAM},
                 num_warps=8)
    compile_sm90(st.row_mass_kernel, {"max_ptr": "*fp32", "sumexp_ptr": "*fp32", "row_max_ptr": "*fp64",
                                      "local_ptr": "*fp64", "tile_mass_ptr": "*fp64", "tile_end_ptr": "*fp64"},
                 {"NUM_TILES": tiles, "BLOCK_T": triton.next_power_of_2(tiles)}, num_warps=4)
    compile_sm90(st.tile_sample_kernel, {"z_ptr": "*fp32", "z_stride": "i64", "tile_mass_ptr": "*fp64",
                                         "tile_end_ptr": "*fp64", "local_ptr": "*fp64", "key_ptr": "*i64",
                                         "bound_ptr": "*fp64", "col_ptr": "*i64"},
                 {"N": 64, "V": shard, "NUM_TILES": tiles, "LOG_TILES": tiles.bit_length(), "TILE": SAMPLE_TILE,
                  "DRAW_BLOCK": st.DRAW_BLOCK, "B_LO": st.B_LO, "B_HI": st.B_HI, "B_START": st.B_START,
                  "B_MASS": st.B_MASS, "B_TOTAL": st.B_TOTAL, "B_BELOW": st.B_BELOW, "NUM_BOUNDS": st.NUM_BOUNDS},
                 num_warps=st.DRAW_WARPS)
    rows = {"idx_ptr": "*i64", "owned_ptr": "*fp32", "label_idx_ptr": "*i64", "label_owned_ptr": "*fp32",
            "stats_ptr": "*fp32", "zs_ptr": "*fp32", "K": "i32", "scale_t": "fp32"}
    stats = {"NUM_STATS": 9, "I_MAX": 0, "I_LABEL": 5, "V": GPT_OSS_VOCAB, "NUM_TILES": 50, "BLOCK_V": 4096,
             "BLOCK_K": 128}
    # E written back with the ghost tail's rest sum, or zeros (renorm reverse / jsd without CE)
    for zeros in (False, True):
        compile_sm90(
            exp_stats_kernel,
            {"z_ptr": "*bf16", "z_stride": "i64", "target_ptr": "*fp32", "repeat_ptr": "*fp32", "ref_ptr": "*fp32",
             "steep": "fp32", **rows},
            {**stats, "I_SUM_T": 1, "I_SUM_1": 2, "I_TDOT": 3, "I_TSUM": 4, "I_REST": 6, "I_SMAX": 7, "I_SSUM": 8,
             "HAS_LABELS": True,
             "SEPARATE_SUM_1": not zeros, "WRITE": True, "WRITE_ZEROS": zeros, "REST_SUM": not zeros},
            num_warps=4,
        )
    fixup = {"x_ptr": "*bf16", "x_stride": "i64", "ref_ptr": "*fp32", "alpha_ptr": "*fp32", "beta_ptr": "*fp32",
             "sparse_scale_ptr": "*fp32", "ghost_ptr": "*fp32", "target_ptr": "*fp32", "label_sparse_ptr": "*fp32",
             "sigma_ptr": "*fp32", "log_target_ptr": "*fp32", "shift_ptr": "*fp32", "center_ptr": "*fp32",
             "tau": "fp32", "inv_tau": "fp32", "jsd_beta": "fp32", "log_beta": "fp32", "log1m_beta": "fp32", **rows}
    # forward: the whole-row rewrite with every term, and the sparse-only common case; reverse with
    # the CE softmax; jsd with the zeroed block (renorm without CE)
    for every_term, divergence, sparse_only in ((True, 0, False), (False, 0, False), (True, 1, False),
                                                (False, 2, True)):
        compile_sm90(grad_fixup_kernel, fixup,
                     {**stats, "HAS_BETA": every_term, "GHOST": every_term and divergence == 0,
                      "HAS_LABELS": every_term, "DIVERGENCE": divergence, "SPARSE_ONLY": sparse_only,
                      "SUPPORT_FRAME": sparse_only}, num_warps=4)
    row_vectors = ("const", "lse_coef", "mass", "rest_mass", "rho", "label_owned", "kd", "ce", "alpha", "beta", "sparse_scale",
                   "ghost", "label_sparse")
    support_vectors = ("zs", "owned", "log_target", "sums", "shift", "center")
    # forward; then reverse / jsd at TP = 1 (sums inline), TP > 1 before and after the sums' all-reduce
    for divergence, sums, tp, block_r in ((0, SUMS_NONE, 2, ROW_TERMS_BLOCK), (1, SUMS_INLINE, 1, ROW_TERMS_SUPPORT_BLOCK),
                                          (2, SUMS_PARTIAL, 2, ROW_TERMS_SUPPORT_BLOCK),
                                          (2, SUMS_LOADED, 2, ROW_TERMS_SUPPORT_BLOCK)):
        compile_sm90(
            row_terms_kernel,
            {"stats_ptr": "*fp32", "rows": "i32", "rank": "i32",
             **{f"{n}_ptr": "*fp32" for n in row_vectors + support_vectors}, "K": "i32",
             "kd_grad_weight": "fp32", "ce_weight": "fp32", "inv_tau": "fp32", "jsd_beta": "fp32", "log_beta": "fp32",
             "log1m_beta": "fp32"},
            {"TP": tp, "NUM_STATS": 9, "I_MAX": 0, "I_SUM_T": 1, "I_SUM_1": 2, "I_TDOT": 3, "I_TSUM": 4, "I_LABEL": 5,
             "I_REST": 6, "I_SMAX": 7, "I_SSUM": 8,
             "GHOST": divergence != 1, "HAS_LABELS": True, "NEED_GRAD": True, "CE_GRAD": True, "SEPARATE_BETA": True,
             "DIVERGENCE": divergence, "SUMS": sums.value, "BLOCK_R": block_r, "BLOCK_KT": ENTRY_TILE,
             "K_TILES": 4 if divergence else 0},
            num_warps=4,
        )
    compile_sm90(
        scale_rows_kernel,
        {"src_ptr": "*fp32", "src_stride": "i64", "scale_ptr": "*fp32", "dst_ptr": "*bf16", "dst_stride": "i64"},
        {"N": 2880, "BLOCK_N": 1024}, num_warps=4,
    )

    # Bf16Adam: 8-bit moments with stochastic rounding (bf16 weights), fp32 moments rounded to nearest
    for quantized, param, stochastic in ((True, tl.bfloat16, True), (False, tl.float32, False)):
        compile_sm90(
            bf16_adam_kernel,
            {"tensors_ptr": "*i64", "grads_ptr": "*i64", "work_ptr": "*i32", "qmap_signed_ptr": "*fp32",
             "qmap_unsigned_ptr": "*fp32", "scalars_ptr": "*fp32", "step_hi": "i32", "step_lo": "i32", "tiny": "fp32"},
            {"P_DTYPE": param, "G_DTYPE": tl.bfloat16, "QUANTIZED": quantized, "ADAM_W": True, "STOCHASTIC": stochastic,
             "BLOCKS": BLOCKS, "BLOCK": 256, "ITEM_BLOCKS": ITEM_BLOCKS},
            num_warps=NUM_WARPS,
        )

    # RoPE / YaRN of GPT-OSS's heads (d 64) in bf16, both directions
    for backward in (False, True):
        compile_sm90(
            _rope_kernel,
            {"t_ptr": "*bf16", "f_ptr": "*fp32", "out_ptr": "*bf16", "batch": "i32", "heads": "i32",
             "t_stride_s": "i32", "t_stride_b": "i32", "t_stride_h": "i32", "f_stride_s": "i32", "f_stride_b": "i32",
             "mscale": "fp32"},
            {"HALF": 32, "BACKWARD": backward, "BLOCK_H": 64}, num_warps=4,
        )

    # the MoE combine's row sums (GPT-OSS width, bf16)
    compile_sm90(_gather_sum_kernel,
                 {"rows_ptr": "*bf16", "order_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": "*bf16", "hidden": "i32"},
                 {"BLOCK": BLOCK_H}, num_warps=4)


if __name__ == "__main__":
    main()
