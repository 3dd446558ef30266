"""MiniMax-H3's reference-to-video partition `transformer_ref` is stored as its `transformer` is: split over the ranks
by `--shard-weights` (FSDP2) and kept in fp8 by `--dtype fp8`, both through contract E on Ulysses 2 with the ref2va
references of tests/test_minimax_h3.py (an image, a video with its soundtrack, an audio clip), in one 2-rank launch.

Sharded, the video and audio latents equal diffusers' own ref2va blocks in one process (fp32, 1e-4), and contract E
reports each rank holding about half of `transformer_ref`'s parameter bytes (its 2 blocks are most of its weights;
left whole it would be 1.0). Negative control: the last rank's shard of `transformer_ref`'s first block zeroed misses
diffusers', so the sharded weights are the ones the references run on. In fp8 every linear weight of
`transformer_ref`'s blocks is stored as float8_e4m3fn on every rank, and the result is within FACTOR times diffusers'
own error for the same storage (its `enable_layerwise_casting` on both transformers, bf16 compute; test_bf16_fp8.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from test_bf16_fp8 import FACTOR, _folder_in_bf16, relative_l2
from test_minimax_h3 import FAMILY, FRAMES, SEED, SIZE, STEPS, loaded, ref2va_reference, reference_inputs
from xdit_test_helpers import TOLERANCE, case_errors, torchrun

CASES = {"sharded": (["--shard-weights"], None), "stale ref shard": (["--shard-weights"], "transformer_ref"),
         "fp8": (["--dtype", "fp8"], None)}


def _shares(stdout: str) -> dict[str, list[float]]:
    """Contract E's first `each rank holds A, B of NAME's; ... parameter bytes` line, as {NAME: [A, B]}."""
    held = stdout.split("each rank holds ")[1].split(" parameter bytes")[0]
    return {part.split(" of ")[1].removesuffix("'s"): [float(s) for s in part.split(" of ")[0].split(", ")]
            for part in held.split("; ")}


@pytest.fixture(scope="module")
def launch(video_model_dirs, tmp_path_factory):
    """Every case through contract E in one 2-rank launch: ({case: output file}, the shares line, inputs, model)."""
    work = tmp_path_factory.mktemp("h3_ref_storage")
    model, inputs = video_model_dirs[FAMILY], work / "in-ref2va.safetensors"
    given = reference_inputs(tiny_models.make_inputs(FAMILY, batch=1, height=SIZE, width=SIZE, num_frames=FRAMES))
    save_file({k: v if k.endswith("_tags") else v.float() for k, v in given.items()}, inputs)  # contract E: floats
    outputs, specs = {}, []
    for name, (flags, stale) in CASES.items():
        outputs[name] = work / f"{name.replace(' ', '-')}.safetensors"
        specs.append({"argv": ["--model", str(model), "--inputs", str(inputs), "--output", str(outputs[name]),
                               "--steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE), "--call",
                               f"seed={SEED}", "--ulysses-degree", "2", *flags],
                      "output": str(outputs[name]), "stale_shard": stale, "report_storage": name == "fp8"})
    (work / "cases.json").write_text(json.dumps(specs))
    run = torchrun(2, "tests/contract_e_cases.py", str(work / "cases.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return outputs, _shares(run.stdout), load_file(inputs), model


@pytest.fixture(scope="module")
def references(launch):
    """diffusers' ref2va blocks in one process: fp32, and fp8 storage with bf16 compute on both transformers."""
    _, _, inputs, model = launch
    fp8 = _folder_in_bf16(model)
    for name in ("transformer", "transformer_ref"):
        getattr(fp8, name).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    return {None: ref2va_reference(model, inputs), "fp8": [t.float() for t in ref2va_reference(fp8, cast)]}


def _block_fraction(model, name: str) -> float:
    """The share of the transformer's parameter bytes that its blocks (what --shard-weights splits) hold."""
    from parallel.loading.weight_sharding import transformer_blocks

    transformer = loaded(model).components[name]
    size = lambda parameters: sum(p.numel() * p.element_size() for p in parameters)  # noqa: E731
    return size(p for block in transformer_blocks(transformer) for p in block.parameters()) / size(transformer.parameters())


def _ours(launch, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    output = launch[0][case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    saved = load_file(output)
    return saved["latents"], saved["audio"]


def test_sharded_transformer_ref_matches_diffusers_ref2va_with_half_its_weights_per_rank(launch, references):
    video, audio = _ours(launch, "sharded")
    expected_video, expected_audio = references[None]
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, f"max |sharded - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"
    shares, blocks = launch[1], _block_fraction(launch[3], "transformer_ref")
    assert set(shares) == {"transformer", "transformer_ref"}, shares
    # half of its blocks and all the rest (embedders, norms, output projection) on each rank; left whole: 1.0
    assert all(abs(share - (1 - blocks / 2)) <= 0.01 for share in shares["transformer_ref"]), (shares, blocks)


def test_a_wrong_transformer_ref_shard_on_one_rank_misses_diffusers(launch, references):
    video, audio = _ours(launch, "stale ref shard")
    expected_video, expected_audio = references[None]
    assert (video - expected_video).abs().max().item() > 100 * TOLERANCE
    assert (audio - expected_audio).abs().max().item() > 100 * TOLERANCE


def test_fp8_stores_transformer_ref_in_fp8_within_diffusers_own_error(launch, references):
    storage = json.loads(launch[0]["fp8"].with_name(launch[0]["fp8"].name + ".storage.json").read_text())
    assert len(storage) == 2 and all(rank["transformer_ref"].get("float8_e4m3fn", 0) > 0 for rank in storage), storage
    ours = _ours(launch, "fp8")
    for part, name in enumerate(("video", "audio")):
        own = relative_l2(references["fp8"][part], references[None][part])
        error = relative_l2(ours[part], references[None][part])
        assert error <= FACTOR * own, f"{name}: relative L2 from fp32 {error:.3g} > {FACTOR} × diffusers' own {own:.3g}"


def test_the_pipeline_transformers_are_named_in_one_place():
    """Sharding, fp8 storage, fp8 matmuls, LoRA and wrapping walk parallel/pipeline_transformers.py's list: a module
    that listed them again would leave out the next one, as these left out `transformer_ref`."""
    root = Path(__file__).resolve().parents[1] / "parallel"
    again = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if '("transformer", "transformer_2"' in path.read_text() and path.name != "pipeline_transformers.py"]
    assert not again, f"{again} list the pipeline's transformers; import TRANSFORMERS or EXPERTS instead"
