"""FLUX.1 Kontext: the noisy tokens and the reference image's tokens are sharded together and stay exact.

test_engine_layouts runs the tiny Kontext model through every layout with a reference of the output's
size (16 + 16 tokens). Here the reference has another size and the sum is odd (16 noisy + 15 reference
tokens = 31, split 16/15 or 8/8/8/7): Ulysses 2, Ring 2, Ulysses 2 × Ring 2, CFG parallel with true CFG,
data parallel — each equal to diffusers' single-process FluxKontextPipeline within 1e-4 (fp32).
Synchronous PipeFusion runs with a reference of the output's size (its patches cut the 32 tokens evenly)
and refuses the odd total, and true CFG without CFG parallel after warm-up. Negative controls: the
reference changes the result; a split without exchange and an uneven split that attends its padding
keys miss by far more. Contract E and a served Ring 2 pool (contract P) run it once each.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases, torchrun

FAMILY, STEPS, GUIDANCE, SIZE = "flux-kontext", 4, 3.5, 64
REFERENCE = (1, 16, 6, 10)  # latents of a 48 × 80 pixel reference image: 3 × 5 = 15 tokens
LAYOUTS = {  # name: (nproc, layout)
    "ulysses2": (2, {"ulysses_degree": 2}),
    "ring2": (2, {"ring_degree": 2}),
    "cfg2": (2, {"cfg_degree": 2}),
    "dp2": (2, {"dp_degree": 2}),
    "pp2-even": (2, {"pipefusion_degree": 2, "warmup_steps": STEPS}),  # 16 + 16 tokens: patches cut evenly
    "ulysses2_ring2": (4, {"ulysses_degree": 2, "ring_degree": 2}),
}
REFUSED = {  # name: (nproc, layout, error)
    "pp2": (2, {"pipefusion_degree": 2, "warmup_steps": STEPS},
            "31 tokens (15 of them the reference images') do not split into 2 PipeFusion patches"),
    "pp2-even-cfg-stale": (2, {"pipefusion_degree": 2, "warmup_steps": 1},
                           "PipeFusion after warm-up with true CFG on FluxKontextPipeline would mix"),
}
CONTROLS = {  # name: (nproc, layout, fault)
    "ulysses2-no_exchange": (2, {"ulysses_degree": 2}, "no_exchange"),
    # 16 + 13 tokens over 4: shards 8/7/7/7, three padded, one of them a copy of noisy token 14
    "ring4-padded_keys": (4, {"ring_degree": 4}, "padded_keys"),
}
PADDED_REFERENCE = (1, 16, 2, 26)


def inputs_for(layout: str) -> dict[str, torch.Tensor]:
    """make_inputs' reference has the output's size; the other cases get one of REFERENCE's."""
    batch = 2 if layout.startswith("dp") else 1
    inputs = tiny_models.make_inputs(FAMILY, batch=batch, height=SIZE, width=SIZE)
    if "even" not in layout.split("-"):
        shape = PADDED_REFERENCE if layout == "ring4-padded_keys" else REFERENCE
        inputs["image"] = torch.randn((batch, *shape[1:]), generator=torch.Generator().manual_seed(7))
    return inputs


def call_kwargs(layout: str) -> dict:
    kwargs = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE}
    if layout.startswith("cfg") or "cfg" in layout.split("-"):
        kwargs["true_cfg_scale"] = 2.0  # Kontext's guidance is distilled: CFG parallel needs true CFG
    return kwargs


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    return {"model": tiny_models.save_tiny_pipeline(FAMILY, root / FAMILY), "work": root}


@pytest.fixture(scope="module")
def runs(kontext):
    """One torchrun launch per rank count; {case: (output path, inputs path)}."""
    work, results = kontext["work"], {}
    cases = {name: (n, layout, None) for name, (n, layout) in LAYOUTS.items()} | CONTROLS
    cases |= {name: (n, layout, None) for name, (n, layout, _) in REFUSED.items()}
    for nproc in sorted({n for n, _, _ in cases.values()}):
        specs = []
        for name, (n, layout, fault) in cases.items():
            if n != nproc:
                continue
            inputs = work / f"{name}.in.safetensors"
            save_file(inputs_for(name), inputs)
            output = work / f"{name}.safetensors"
            specs.append({"name": name, "model": str(kontext["model"]), "inputs": str(inputs), "output": str(output),
                          "layout": layout, "call": call_kwargs(name), "fault": fault})
            results[name] = (output, inputs)
        run_engine_cases(nproc, specs, work)
    return results


def _compare(runs, kontext, name) -> tuple[torch.Tensor, torch.Tensor]:
    output, inputs = runs[name]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    expected = diffusers_latents(kontext["model"], FAMILY, **load_file(inputs), **call_kwargs(name))
    return load_file(output)["latents"], expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_with_reference_matches_single_process_diffusers(runs, kontext, layout):
    parallel, expected = _compare(runs, kontext, layout)
    assert parallel.shape == expected.shape == (2 if layout == "dp2" else 1, 16, 64)
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{layout}: max |parallel - diffusers| = {error:.3g}"


@pytest.mark.parametrize("control", CONTROLS)
def test_negative_controls_miss_by_far_more(runs, kontext, control):
    parallel, expected = _compare(runs, kontext, control)
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("case", REFUSED)
def test_pipefusion_refuses_what_it_cannot_cut(runs, case):
    output, _ = runs[case]
    errors = case_errors(output)
    assert errors and not output.exists()
    assert "LayoutError" in errors and REFUSED[case][2] in errors


def test_the_reference_image_matters(kontext):
    """Without this the layouts above could pass while ignoring the reference tokens."""
    inputs = inputs_for("ulysses2")
    with_reference = diffusers_latents(kontext["model"], FAMILY, **inputs, **call_kwargs("ulysses2"))
    del inputs["image"]
    without = diffusers_latents(kontext["model"], FAMILY, **inputs, **call_kwargs("ulysses2"))
    assert (with_reference - without).abs().max().item() > 100 * TOLERANCE


def test_contract_e_ulysses2_equals_diffusers(kontext, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(inputs_for("ulysses2"), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(kontext["model"]), "--inputs", str(inputs),
                   "--output", str(output), "--steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE),
                   "--guidance-scale", str(GUIDANCE), "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = diffusers_latents(kontext["model"], FAMILY, **load_file(inputs), **call_kwargs("ulysses2"))
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


def test_pool_job_with_a_reference_equals_diffusers(kontext, tmp_path):
    """Contract P: a served Ring 2 pool takes `image` as one of the pipeline's tensor inputs (31 tokens, uneven)."""
    from pool_helpers import free_endpoint, idle_client, reference, start_serve, stop_serve

    endpoint = free_endpoint()
    process = start_serve(kontext["model"], endpoint, "--nproc", "2", "--ring-degree", "2", log=tmp_path / "serve.log")
    client = None
    try:
        client, status = idle_client(endpoint)
        assert status["pipeline"] == "FluxKontextPipeline"
        inputs = inputs_for("ring2")
        params = {"steps": STEPS, "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE}
        latents = client.sample(inputs, params)
        expected = reference(kontext["model"], FAMILY, inputs, params)
        assert latents.shape == expected.shape == (1, 16, 64)
        assert (latents - expected).abs().max().item() <= TOLERANCE
    finally:
        if client is not None:
            client.close()
        stop_serve(process)
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]


def test_comfyui_reference_latent_workflow_equals_diffusers(comfy, kontext):
    """ComfyUI's Kontext graph: a reference LATENT (here LoadLatent, 48 × 80 px) → ReferenceLatent on the
    positive → xDiT Sampler on Ring 2; the saved latent equals diffusers with that reference as `image`."""
    from test_comfyui import FAMILIES, reference, saved_latent, workflow

    _, _, scale, shift = FAMILIES[FAMILY]
    vae_space = torch.randn(REFERENCE, generator=torch.Generator().manual_seed(3))
    save_file({"latent_tensor": vae_space, "latent_format_version_0": torch.tensor([])}, comfy.work / "output" / "ref.latent")
    graph = workflow(FAMILY, ulysses=1, ring=2)
    graph["8"] = {"class_type": "LoadLatent", "inputs": {"latent": "ref.latent [output]"}}
    graph["9"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["2", 0], "latent": ["8", 0]}}
    graph["5"]["inputs"]["positive"] = ["9", 0]
    entry = comfy.wait(comfy.queue(graph))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    expected = reference(kontext["model"], FAMILY, image=(vae_space - shift) * scale)
    assert saved_latent(comfy, entry).shape == expected.shape == (1, 16, 8, 8)
    assert (saved_latent(comfy, entry) - expected).abs().max().item() <= TOLERANCE
    assert (reference(kontext["model"], FAMILY) - expected).abs().max().item() > 100 * TOLERANCE

    del graph["9"], graph["8"]
    graph["5"]["inputs"]["positive"] = ["2", 0]  # no ReferenceLatent: text alone, as ComfyUI's Kontext
    entry = comfy.wait(comfy.queue(graph))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    assert (saved_latent(comfy, entry) - reference(kontext["model"], FAMILY)).abs().max().item() <= TOLERANCE
