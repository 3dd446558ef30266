"""Runs many (family, layout) cases in one torchrun job, re-initialising the mesh between cases.

    torchrun --nproc-per-node N tests/engine_cases.py CASES.json

Each case in CASES.json: {"name", "model", "inputs", "output", "layout": {ParallelConfig fields},
"call": {extra __call__ kwargs}, "dtype", "scheduler", "fault", "report_memory", "report_storage",
"report_flow", "report_prefix_cache"}. Rank 0 writes each case's
latents (and what the pipeline returns beside them, under its names: LTX-2's `audio`); a rank that fails writes its traceback to output + ".error" (rank 0) or ".error.rank<N>" (rank N), which
the tests read all together with xdit_test_helpers.case_errors. One launch amortises process-group start-up and
imports over the whole matrix, and exercises tearing the layout down and building it again.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parallel.layout.config import ParallelConfig
from parallel.distributed import destroy_distributed_environment, get_sp_group, init_distributed_environment
from parallel.loading.pipelines import load_pipeline, set_scheduler
from parallel.model_executor.layout_scope import under_layout
from parallel.cli.torchrun_exit import exit_after_work
from parallel.model_executor import pipefusion
from parallel.model_executor.attention import seam as attention_seam
from parallel.model_executor.attention import usp as attention_usp

_USP, _KEY_SHARDS = attention_seam.usp_attention, attention_seam.key_shard_attention
_PATCH_COPY = pipefusion.patch_copy
_JOIN_HEAD_GROUPS, _BIAS_COLUMNS = attention_usp._join_head_groups, attention_usp._bias_columns


def _forgetful_patch_copy(scheduler, rows):
    """Negative control for PipeFusion's flow: each patch's scheduler starts without the multistep history."""
    patch = _PATCH_COPY(scheduler, rows)
    patch.model_outputs = [None] * len(patch.model_outputs)
    patch.lower_order_nums = 0
    return patch


def _swap_audio_rows(module, args, kwargs):
    """Negative control for the audio stream: sequence-parallel rank 1 holds the audio rows rolled by half (LTX-2's
    replicated audio disagrees with rank 0's; in MiniMax-H3's split sequence, rank 1's shard holds rank 0's audio rows
    under its own rows' tags and positions)."""
    if get_sp_group().rank_in_group == 1:
        audio = kwargs["audio_hidden_states"]
        kwargs["audio_hidden_states"] = audio.roll(audio.shape[1] // 2, dims=1)
    return args, kwargs


FLOW_FAULTS = {"forgetful_patches": _forgetful_patch_copy}
INPUT_FAULTS = {"swapped_audio": _swap_audio_rows}
# Negative control for replicated queries: each rank's audio attends to its own video keys only, no merge.
KEY_FAULTS = {"own_keys_only": lambda q, k, v, *, sp, kernel, scale=None, real=None: kernel(q, k, v, scale or q.shape[-1] ** -0.5)[0]}
# Negative control for the overlapped Ulysses: the head groups' outputs joined group after group, not per rank.
GROUP_FAULTS = {"groups_out_of_order": lambda parts, u: torch.cat(parts, dim=1)}
# Negative control for a plan's attention mask in Ring: every key block takes the mask's leading columns, not its own.
COLUMN_FAULTS = {"mask_columns_not_sliced": lambda bias, ring, keep, block: [
    bias[..., : c.shape[-1]] for c in _BIAS_COLUMNS(bias, ring, keep, block)]}
FAULTS = {
    # Negative control: attention on the local shard only, i.e. a sequence split with no exchange.
    "no_exchange": lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    # Negative control for uneven token splits: attention also sees the padding keys.
    "padded_keys": lambda q, k, v, keep=None, **kw: _USP(q, k, v, **kw),
    # Negative control for a plan's attention mask (ParallelPlan.attention_masks): rank 1's chunk of it masks nothing
    # (zeroed in place: the one mask of the call, which USP gathers once per call on every rank alike).
    "mask_dropped_on_rank1": lambda q, k, v, bias=None, **kw: _USP(
        q, k, v, bias=bias.zero_() if bias is not None and get_sp_group().rank_in_group == 1 else bias, **kw),
}


def block_bytes(transformer) -> int:
    """Parameter bytes of the repeated blocks this rank holds."""
    lists = [m for name, m in transformer.named_children() if name.endswith("transformer_blocks")]
    return sum(p.numel() * p.element_size() for blocks in lists for p in blocks.parameters())


def run_case(case: dict, rank: int) -> None:
    pipeline = load_pipeline(case["model"], dtype=case.get("dtype"))
    set_scheduler(pipeline, case.get("scheduler", "default"))
    all_blocks = block_bytes(pipeline.transformer)
    with under_layout(pipeline, ParallelConfig(**case["layout"])) as parallel:
        if case.get("report_memory"):
            mine = torch.tensor([block_bytes(parallel.module.transformer.module)])
            every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, mine)
            if rank == 0:
                report = [{"rank": r, "block_parameter_bytes": int(t), "all_block_parameter_bytes": all_blocks}
                          for r, t in enumerate(every)]
                Path(case["output"] + ".memory.json").write_text(json.dumps(report))
        if case.get("report_storage"):  # the transformer's parameter bytes per storage format, on every rank
            from parallel.loading.checkpoints.fp8 import storage_of

            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, storage_of(parallel.module.transformer.module))
            if rank == 0:
                Path(case["output"] + ".storage.json").write_text(json.dumps(every))
        fault, hook = case.get("fault"), None
        if fault in FLOW_FAULTS:
            pipefusion.patch_copy = FLOW_FAULTS[fault]
        elif fault in INPUT_FAULTS:
            hook = parallel.module.transformer.module.register_forward_pre_hook(INPUT_FAULTS[fault], with_kwargs=True)
        elif fault in KEY_FAULTS:
            attention_seam.key_shard_attention = KEY_FAULTS[fault]
        elif fault in GROUP_FAULTS:
            attention_usp._join_head_groups = GROUP_FAULTS[fault]
        elif fault in COLUMN_FAULTS:
            attention_usp._bias_columns = COLUMN_FAULTS[fault]
        elif fault:
            attention_seam.usp_attention = FAULTS[fault]
        try:
            output = parallel(**load_file(case["inputs"]), **case["call"], output_type="latent", return_dict=False)
        finally:
            attention_seam.usp_attention, attention_seam.key_shard_attention = _USP, _KEY_SHARDS
            pipefusion.patch_copy = _PATCH_COPY
            attention_usp._join_head_groups, attention_usp._bias_columns = _JOIN_HEAD_GROUPS, _BIAS_COLUMNS
            if hook is not None:
                hook.remove()
        if case.get("report_prefix_cache"):  # Qwen-Image 2.1's prefix K/V per rank: layers stored, bytes, still held
            from parallel.families.qwenimage21 import LIVE

            held = parallel.prefix_cache
            mine = torch.tensor([held["stores"], held["bytes"], len(LIVE)])
            every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, mine)
            if rank == 0:
                report = [dict(zip(("rank", "stores", "bytes", "live"), (r, *map(int, t)))) for r, t in enumerate(every)]
                Path(case["output"] + ".prefix.json").write_text(json.dumps(report))
        if case.get("report_flow") and rank == 0:  # whether the last step's patches flowed on
            Path(case["output"] + ".flow.json").write_text(json.dumps(parallel.module.transformer._stage.flowed))
    if rank == 0:  # the latents, and what the pipeline returns beside them (LTX-2's audio) under its names
        outputs = {"latents": output[0], **dict(zip(parallel.extra_outputs, output[1:]))}
        save_file({name: tensor.contiguous() for name, tensor in outputs.items()}, case["output"])


def main(spec: str, run=None, error_suffix=lambda rank: "" if rank == 0 else f".rank{rank}") -> int:
    """Every case of `spec` through `run(case, rank)` (this module's run_case by default) in one world; a
    failing case leaves its traceback in output + ".error" + error_suffix(rank) and the matrix goes on."""
    torch.set_num_threads(1)
    world = init_distributed_environment()
    for case in json.loads(Path(spec).read_text()):
        try:
            (run or run_case)(case, world.rank)
        except Exception:  # recorded per case; the matrix goes on
            Path(case["output"] + ".error" + error_suffix(world.rank)).write_text(traceback.format_exc())
    destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    exit_after_work(main(sys.argv[1]))
