"""The pipeline's own checks run once per job on rank 0: its server checks a job at submit and the run
reuses those arguments (`prepared`). Real torchrun ranks (tests/checks_once_case.py) count the checks;
the latents equal diffusers' for the same call (Wan 2.2 with guidance_scale_2, frames from the latents)."""

from __future__ import annotations

import json

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from xdit_test_helpers import TOLERANCE, torchrun

FAMILY = "wan22"


def test_rank0_checks_a_job_once(video_model_dirs, tmp_path):
    model = video_model_dirs[FAMILY]
    inputs, prefix = tmp_path / "in.safetensors", tmp_path / "job"
    save_file(tiny_models.make_inputs(FAMILY, height=64, width=64, num_frames=5), inputs)
    run = torchrun(2, "tests/checks_once_case.py", str(model), str(inputs), str(prefix))
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads((tmp_path / "job.json").read_text())
    assert counts["prepared"] == [1, 1], "rank 0 checks at submit and reuses that; rank 1 checks when it runs"
    assert counts["unprepared"] == [2, 1], "negative control: without `prepared` rank 0 checks twice"

    pipeline = DiffusionPipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = pipeline(**load_file(inputs), num_inference_steps=3, guidance_scale=5.0, guidance_scale_2=2.0,
                            height=64, width=64, num_frames=5, output_type="latent", return_dict=False)[0]
    for mode in ("prepared", "unprepared"):
        latents = load_file(f"{prefix}.{mode}.safetensors")["latents"]
        assert (latents - expected).abs().max().item() <= TOLERANCE
