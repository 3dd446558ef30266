"""The engine on the GPU, in this process (a one-rank NCCL world), against diffusers on the same card:

- `--compile` (every block's forward through torch.compile, inductor on CUDA) within 1.5× diffusers' own bf16 error;
- fp8 storage (ComfyUI's scaled fp8) and GGUF Q8_0 files of a FLUX.1-width model kept quantized, within 1.5×
  diffusers' own bf16 error on the weights each file means; with `--fp8-matmul` every fp8 layer on
  `torch._scaled_mm` (compute capability 8.9+) within 5e-2 of diffusers' fp32 result on those weights (as on the
  CPU, tests/test_fp8_matmul.py), a matmul with the weight scales doubled missing it;
- the peak memory of a transformer call on the card against bench/memory_table.py's analytic model;
- parallel/distributed/devices.py with the real device queries.
Speed (fp8 matmul against bf16, compile against eager) is bench's: scripts/gpu_check.sh records it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from parallel.cli.launch import ROOT

from conftest import FACTOR, bench_model, call_of, diffusers_run, inputs_of, relative_l2

SMALL = (1, 2)  # FLUX.1-width with 1 double + 2 single blocks: the quantized files are written and read fast


def engine_run(pipeline, inputs: dict, call: dict, **layout) -> torch.Tensor:
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor.layout_scope import under_layout

    with under_layout(pipeline, ParallelConfig(**layout)) as parallel, torch.no_grad():
        return parallel(**{k: v.to("cuda", torch.bfloat16) for k, v in inputs.items()}, **call)[0].float().cpu()


def test_compile_is_within_diffusers_own_bf16_error(world, flux_width, record):
    from parallel.loading.pipelines import load_pipeline

    pipeline = load_pipeline(flux_width["folder"], dtype="bf16")
    compiled = engine_run(pipeline, flux_width["inputs"], flux_width["call"], compile=True)
    error = relative_l2(compiled, flux_width["reference"]["fp32"])
    record("compile_relative_l2_from_fp32", error)
    assert error <= FACTOR * flux_width["own_error"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The small FLUX.1-width model as bf16, scaled-fp8 and GGUF Q8_0 files, the weights each means, inputs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from original_layouts import original_layout
    from quantized_files import fp8_scaled, gguf_file
    from safetensors.torch import save_file

    model = bench_model(SMALL)
    donor = model.pipeline()
    root = tmp_path_factory.mktemp("quantized")
    weights = original_layout("flux", donor.transformer)
    fp8_stored, fp8_meant = fp8_scaled(weights, per_layer=False)
    paths = {"fp8": root / "flux1-dev-fp8_scaled.safetensors", "gguf": root / "flux1-dev-Q8_0.gguf",
             "fp8-meant": root / "flux1-dev-fp8-meant.safetensors", "gguf-meant": root / "flux1-dev-gguf-meant.safetensors"}
    save_file(fp8_stored, paths["fp8"])
    gguf_meant = gguf_file(weights, paths["gguf"], "flux", as_diffusers=True)
    for kind, meant in (("fp8", fp8_meant), ("gguf", gguf_meant)):
        save_file({k: v.float().contiguous() for k, v in meant.items()}, paths[f"{kind}-meant"])
    return {"model": model, "paths": paths, "inputs": inputs_of(model, donor), "call": call_of(model)}


def _meant_pipeline(quantized, kind: str):
    """diffusers' pipeline (from_single_file, as tests/test_fp8.py loads it) with the weights the file means."""
    from parallel.loading.pipelines import load_pipeline

    return load_pipeline(quantized["paths"][f"{kind}-meant"], dtype="fp32")


@pytest.mark.parametrize("kind", ["fp8", "gguf"])
def test_quantized_files_kept_quantized_are_within_diffusers_own_bf16_error(world, quantized, record, kind):
    from parallel.loading.checkpoints.fp8 import storage_of
    from parallel.loading.pipelines import load_pipeline

    meant = _meant_pipeline(quantized, kind)
    fp32 = diffusers_run(meant, quantized["inputs"], torch.float32, quantized["call"])
    own = relative_l2(diffusers_run(meant, quantized["inputs"], torch.bfloat16, quantized["call"]), fp32)
    pipeline = load_pipeline(quantized["paths"][kind])  # bf16 compute, the weights kept quantized on the card
    assert ({"float8_e4m3fn"} if kind == "fp8" else {"Q8_0"}) <= set(storage_of(pipeline.transformer))
    ours = engine_run(pipeline, quantized["inputs"], quantized["call"], fp8_matmul=False)
    error = relative_l2(ours, fp32)
    record(f"{kind}_storage_relative_l2_from_fp32", {"ours": error, "diffusers_bf16": own})
    assert error <= FACTOR * own


def test_fp8_matmul_on_the_card(world, quantized, record):
    from parallel.loading.checkpoints.fp8 import use_fp8_matmul
    from parallel.loading.checkpoints.fp8_matmul import hardware_mode
    from parallel.loading.pipelines import load_pipeline

    mode = hardware_mode(torch.device("cuda", 0))
    capability = torch.cuda.get_device_capability(0)
    assert mode == (None if capability < (8, 9) else "tensor" if capability < (9, 0) else "row")
    meant = _meant_pipeline(quantized, "fp8")
    fp32 = diffusers_run(meant, quantized["inputs"], torch.float32, quantized["call"])
    pipeline = load_pipeline(quantized["paths"]["fp8"])
    ours = engine_run(pipeline, quantized["inputs"], quantized["call"])  # the default: a ComfyUI fast file
    layers = use_fp8_matmul(pipeline, None)
    error = relative_l2(ours, fp32)
    record("fp8_matmul", {"mode": mode, "layers": layers, "relative_l2_from_fp32": error})
    assert (layers > 0) == (mode is not None) and error <= 5e-2
    for layer in pipeline.transformer.modules():  # negative control: a matmul with the weight scales doubled
        if getattr(layer, "matmul", None):
            layer.scale = layer.scale * 2
    if mode is not None:
        assert relative_l2(engine_run(pipeline, quantized["inputs"], quantized["call"]), fp32) > 0.2


@pytest.mark.parametrize("mode, how", [("row", "triton"), ("row", "compiled"), ("tensor", "compiled")])
def test_the_fused_fp8_quantizers_equal_the_eager_passes(mode, how):
    """On CUDA `linear` quantizes its activations in one kernel (fp8_rows' Triton kernel per row, torch.compile's
    fusion per tensor): the eager four passes' scales exactly and their fp8 codes but for rounding (a Triton
    division may round otherwise: one code at most, rarely), at FLUX.1's widths and at token counts that change
    between calls (as the text and image streams do). Built here without `quantizer`'s eager fallback, so a kernel
    that does not build fails the test instead of hiding behind the fallback."""
    from parallel.loading.checkpoints.fp8_matmul import kernel, quantize

    fused = kernel(mode, how)
    for tokens, width in ((512, 3072), (4608, 3072), (4096, 12288), (4608, 15360)):
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) * 3
        (q, scale), (q_eager, scale_eager) = fused(x), quantize(x, mode)
        codes = (q.view(torch.uint8).int() - q_eager.view(torch.uint8).int()).abs()
        assert torch.equal(scale, scale_eager) and codes.max() <= 1 and codes.float().mean() < 1e-3
    noisy = fused(x + torch.randn_like(x))[0]  # control: other activations give other codes
    assert (noisy.view(torch.uint8) != q_eager.view(torch.uint8)).float().mean() > 0.1


def test_peak_memory_of_a_call_against_the_memory_table(world, record):
    """Qwen-Image's width (24 heads of 128, MLP 12288) with 2 of its blocks at 1328² and 512 text tokens, one
    transformer call on the card: the allocator's peak above the weights against bench.memory_table's qwen_peak."""
    from diffusers import QwenImageTransformer2DModel

    from bench.memory_table import Joint, qwen_peak

    tokens, text = (1328 // 16) ** 2, 512
    with torch.device("cuda"):
        transformer = QwenImageTransformer2DModel(num_layers=2, attention_head_dim=128, num_attention_heads=24,
                                                  joint_attention_dim=3584).to(torch.bfloat16).eval()
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    embeds = torch.randn(1, text, 3584, device="cuda", dtype=torch.bfloat16, generator=generator)
    call = {"hidden_states": hidden, "encoder_hidden_states": embeds, "timestep": torch.ones(1, device="cuda"),
            "img_shapes": [[(1, 1328 // 16, 1328 // 16)]], "return_dict": False}
    with torch.no_grad():
        transformer(**call)  # kernels and their workspaces, once
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        transformer(**call)
        torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    predicted = qwen_peak(Joint("qwen", dim=3072, heads=24, head_dim=128, mlp=12288, image_tokens=tokens,
                                text_tokens=text), 1, 1)["peak"]
    record("peak_memory_qwen_width_1328", {"measured_bytes": measured, "predicted_bytes": predicted,
                                           "ratio": measured / predicted})
    assert 0.75 <= measured / predicted <= 1.33, (measured, predicted)


def test_the_device_plan_with_the_real_queries(record):
    from parallel.distributed.devices import CudaQueries, plan_devices

    count = torch.cuda.device_count()
    plan = plan_devices(count, CudaQueries(), environment={})
    record("devices", {"cards": [c.describe() for c in plan.cards], "p2p": plan.p2p, "mixed": plan.mixed})
    assert [c.name for c in plan.cards] == [torch.cuda.get_device_name(i) for i in range(count)]
    assert plan.backend == "nccl" and plan.device_of(0) is not None
    peers = all(torch.cuda.can_device_access_peer(a, b) for a in range(count) for b in range(count) if a != b)
    assert plan.p2p == ("n/a" if count == 1 else "on" if peers else "off")


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_the_cuda_attention_kernels_equal_the_math_kernel(kernel):
    """USP's kernels on the card (output and log-sum-exp, which Ring's merge needs) against the plain formula."""
    from parallel.model_executor.attention.kernels import KERNELS, default_scale

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    out, lse = KERNELS[kernel](q, k, v, default_scale(q))
    expected, expected_lse = KERNELS["math"](q, k, v, default_scale(q))
    assert relative_l2(out, expected) < 1e-2 and (lse - expected_lse).abs().max().item() < 1e-2


def test_two_ranks_sharing_the_card_run_ulysses_over_gloo(tmp_path, record):
    """--share-gpus: 2 ranks on this one card (round-robin), the world over gloo, Ulysses 2, through contract E with
    the tiny Flux in bf16, within 1.5× diffusers' own bf16 error on this card."""
    from safetensors.torch import load_file, save_file

    from parallel.loading import tiny_models

    from xdit_test_helpers import torchrun

    folder = tiny_models.save_tiny_pipeline("flux", tmp_path / "flux")
    inputs = tiny_models.make_inputs("flux")
    save_file(inputs, tmp_path / "in.safetensors")
    call = {"num_inference_steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64, "output_type": "latent",
            "return_dict": False}
    pipeline = tiny_models.build_tiny_pipeline("flux")
    fp32 = diffusers_run(pipeline, inputs, torch.float32, call)
    own = relative_l2(diffusers_run(pipeline, inputs, torch.bfloat16, call), fp32)
    run = torchrun(2, "-m", "parallel.run", "--model", str(folder), "--inputs", str(tmp_path / "in.safetensors"),
                   "--output", str(tmp_path / "out.safetensors"), "--dtype", "bf16", "--steps", "4",
                   "--guidance-scale", "3.5", "--height", "64", "--width", "64", "--ulysses-degree", "2", "--share-gpus")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ranks share 1 card" in run.stdout or torch.cuda.device_count() > 1
    error = relative_l2(load_file(tmp_path / "out.safetensors")["latents"], fp32)
    record("share_gpus_ulysses2_relative_l2_from_fp32", {"ours": error, "diffusers_bf16": own})
    assert error <= FACTOR * own
