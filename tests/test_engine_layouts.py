"""Every family × every layout through real torchrun ranks equals diffusers' single-process pipeline.

Two torchrun launches (2 and 4 ranks) run the whole matrix; each parametrised test then checks one
case against the reference computed here, in one process, by the unmodified diffusers pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases

STEPS, SIZE = 4, 64
# Every layout with Ulysses runs with its communication overlapped: a rank's heads in two groups, the next group's
# all-to-all in flight while this one attends (capped at one group a head: Ulysses 4 of 4 heads runs one); Ring
# always prefetches its next K/V block. The same layouts with the overlap off: test_overlap.py, on against off.
OVERLAP = {"ulysses_overlap_groups": 2}
LAYOUTS = {
    2: {
        "ulysses2": {"ulysses_degree": 2, **OVERLAP},
        "ring2": {"ring_degree": 2},
        "cfg2": {"cfg_degree": 2},
        "dp2": {"dp_degree": 2},
    },
    4: {
        "ulysses4": {"ulysses_degree": 4, **OVERLAP},
        "ring4": {"ring_degree": 4},
        "ulysses2_ring2": {"ulysses_degree": 2, "ring_degree": 2, **OVERLAP},
        "cfg2_ulysses2": {"cfg_degree": 2, "ulysses_degree": 2, **OVERLAP},
    },
}
EXTRA = {  # (family, layout, scheduler): further cases on top of the matrix
    2: [("pixart-alpha", "ulysses2", "ddim"), ("pixart-sigma", "ring2", "euler"), ("flux", "ulysses2", "truecfg")],
}
CASES = [(n, f, l, "default") for n, layouts in LAYOUTS.items() for f in tiny_models.FAMILIES for l in layouts
         if tiny_models.MODELS[f].cfg or "cfg" not in l]  # FLUX.2 [dev] has no CFG to split
CASES += [(n, f, l, s) for n, extra in EXTRA.items() for f, l, s in extra]


def call_kwargs(family: str, layout: str, variant: str) -> dict:
    tiny = tiny_models.MODELS[family]
    kwargs = {"num_inference_steps": STEPS, "guidance_scale": tiny.guidance, "height": SIZE, "width": SIZE}
    if layout.startswith("cfg") or variant == "truecfg":
        kwargs.update(tiny.true_cfg)
    return kwargs


def case_name(nproc, family, layout, variant) -> str:
    return f"{family}-{layout}" + ("" if variant == "default" else f"-{variant}")


def reference(model_dir: Path, inputs: Path, family: str, layout: str, variant: str) -> torch.Tensor:
    scheduler = variant if variant in ("ddim", "euler") else None
    return diffusers_latents(model_dir, family, scheduler=scheduler, **load_file(inputs), **call_kwargs(family, layout, variant))


@pytest.fixture(scope="module")
def matrix(tiny_model_dirs, tmp_path_factory):
    """Run both launches once; return {case: (parallel result or error text, reference)}."""
    work = tmp_path_factory.mktemp("matrix")
    results = {}
    for nproc in LAYOUTS:
        specs = []
        for case in [c for c in CASES if c[0] == nproc] + [(nproc, f, "ulysses2", "fault") for f in tiny_models.FAMILIES if nproc == 2]:
            _, family, layout, variant = case
            layout_kwargs = LAYOUTS[nproc].get(layout, {"ulysses_degree": 2})
            batch = 2 if layout.startswith("dp") else 1
            inputs = work / f"{family}-b{batch}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(family, batch=batch, height=SIZE, width=SIZE), inputs)
            name = case_name(*case)
            specs.append({
                "name": name,
                "model": str(tiny_model_dirs[family]),
                "inputs": str(inputs),
                "output": str(work / f"{name}.safetensors"),
                "layout": layout_kwargs,
                "call": call_kwargs(family, layout, variant),
                "scheduler": variant if variant in ("ddim", "euler") else "default",
                "fault": "no_exchange" if variant == "fault" else None,
            })
            results[case] = (Path(specs[-1]["output"]), inputs)
        run_engine_cases(nproc, specs, work)
    return results, tiny_model_dirs


def _result(matrix, case):
    results, dirs = matrix
    output, inputs = results[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    _, family, layout, variant = case
    return load_file(output)["latents"], reference(dirs[family], inputs, family, layout, variant)


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_layout_matches_single_process_diffusers(matrix, case):
    parallel, expected = _result(matrix, case)
    assert parallel.shape == expected.shape
    assert torch.isfinite(parallel).all()
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| = {error:.3g}"


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_negative_control_sequence_split_without_exchange_fails(matrix, family):
    """The 1e-4 check must catch a sequence split whose attention never sees the other shards."""
    parallel, expected = _result(matrix, (2, family, "ulysses2", "fault"))
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE
