"""Single-file transformer checkpoints (parallel/loading/checkpoints): detection, loading, and the clear errors.

Tiny checkpoints are written in the ORIGINAL single-file layouts (BFL Flux, SAI SD3, PixArt's own) by the
inverse of diffusers' key conversion, from a tiny diffusers transformer; loading the file must give the
same pipeline output as loading the diffusers folder the transformer came from. No hub access:
HF_HUB_OFFLINE is set for the whole module.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import socket
import types

import huggingface_hub.constants
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from safetensors.torch import save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints import CheckpointFile, detect_checkpoint
from parallel.loading.checkpoints.detect import CONFIGS, supported_variants
from parallel.loading.pipelines import load_pipeline
from original_layouts import original_layout
from quantized_files import fp8_scaled
from xdit_test_helpers import TOLERANCE, at_requested_size, import_node_module, torchrun

os.environ["HF_HUB_OFFLINE"] = "1"  # read at import by the torchrun ranks' huggingface_hub


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No hub, and no network at all: any connection attempt in this process fails the test."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(sock, address):
        raise AssertionError(f"network access to {address} during a single-file test")

    monkeypatch.setattr(socket.socket, "connect", refuse)

# variant: (tiny family, changes to the tiny transformer so it is a small model of that variant). Where no
# weight shows the head size it is the architecture's own: SD3 64, PixArt 72.
VARIANTS = {
    "flux1-dev": ("flux", {}),
    "flux1-schnell": ("flux", {"guidance_embeds": False}),
    "flux1-kontext-dev": ("flux-kontext", {}),  # FLUX.1 dev's shapes: told apart by the file's name
    "sd3-medium": ("sd3", {"num_attention_heads": 2, "attention_head_dim": 64, "caption_projection_dim": 128}),
    "sd3.5-medium": ("sd3", {"qk_norm": "rms_norm", "dual_attention_layers": (0, 1)}),
    "sd3.5-large": ("sd3", {"qk_norm": "rms_norm"}),
    # α-1024-MS: micro-conditions (resolution, aspect ratio), which the pipeline feeds at sample size 128 only
    "pixart-alpha-1024": ("pixart-alpha", {"num_attention_heads": 2, "attention_head_dim": 72,
                                           "cross_attention_dim": 144, "use_additional_conditions": True,
                                           "sample_size": 128}),
    "pixart-sigma-1024": ("pixart-sigma", {"num_attention_heads": 2, "attention_head_dim": 72,
                                           "cross_attention_dim": 144}),
    "qwen-image": ("qwen-image", {}),
    "z-image": ("z-image", {}),
    "krea2": ("krea2", {}),
    # Wan's head size is 128 in every released model (the single-file reader assumes it)
    "wan2.1-t2v-1.3b": ("wan", {"num_attention_heads": 2, "attention_head_dim": 128}),
    "wan2.2-ti2v-5b": ("wan22-5b", {"num_attention_heads": 2, "attention_head_dim": 128}),
}


# ---------------------------------------------------------------------------------------------- fixtures
def _variant_pipeline(variant: str):
    family, changes = VARIANTS[variant]
    pipe = tiny_models.build_tiny_pipeline(family, seed=3)
    if changes:
        cls = type(pipe.transformer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            # without "_use_default_values", which would make from_config ignore `changes` to defaulted keys
            config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
            transformer = cls.from_config({**config, **changes}).eval()
        tiny_models._peak_attention(transformer, tiny_models.QK_SCALE)
        pipe = type(pipe)(**{**pipe.components, "transformer": transformer})
    return pipe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (diffusers folder, original-layout .safetensors); PixArt-Σ also as a .pth."""
    root = tmp_path_factory.mktemp("single_file")
    out = {}
    for variant, (family, _) in VARIANTS.items():
        pipe = _variant_pipeline(variant)
        folder = root / variant
        pipe.save_pretrained(folder, safe_serialization=True)
        weights = original_layout(family, pipe.transformer)
        path = root / f"{variant}.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
        out[variant] = (folder, path)
        if variant == "pixart-sigma-1024":
            torch.save({"state_dict": weights}, root / "PixArt-Sigma-XL-2-1024-MS.pth")
    return out


def _run(pipe, family: str) -> torch.Tensor:
    video = {"num_frames": 5} if family in tiny_models.VIDEO_FAMILIES else {}
    call = {**tiny_models.make_inputs(family, **video), **video, **tiny_models.PIPELINE_CALL_DEFAULTS[family],
            "guidance_scale": tiny_models.MODELS[family].guidance, "height": 64, "width": 64, "num_inference_steps": 4}
    with torch.no_grad():
        return pipe(**at_requested_size(pipe, call), output_type="latent", return_dict=False)[0]


def _same_scheduler(file_pipe, folder_pipe, family: str) -> None:
    """Both pipelines on the file's shipped scheduler, so only the transformer and its config can differ.

    PixArt's shipped scheduler predicts epsilon, which blows an untrained tiny model's latents up ~150x and
    makes 1e-4 meaningless; its v-prediction twin keeps them O(1).
    """
    scheduler = file_pipe.scheduler
    if family.startswith("pixart"):
        scheduler = DPMSolverMultistepScheduler.from_config(scheduler.config, prediction_type="v_prediction")
    file_pipe.scheduler = scheduler
    folder_pipe.scheduler = type(scheduler).from_config(scheduler.config)


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("variant", VARIANTS)
def test_detection(checkpoints, variant):
    family, _ = VARIANTS[variant]
    folder, path = checkpoints[variant]
    detected = detect_checkpoint(path)
    assert (detected.variant, detected.family) == (variant, family)
    reference = load_pipeline(folder).transformer.config
    for key, value in detected.overrides.items():  # every value read from the shapes matches the real config
        expected = reference[key]
        if key == "interpolation_scale" and expected is None:  # diffusers' default for this sample size
            expected = max(reference.sample_size // 64, 1)
        assert value == (list(expected) if isinstance(expected, tuple) else expected), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_file_equals_folder(checkpoints, variant):
    family, _ = VARIANTS[variant]
    folder, path = checkpoints[variant]
    file_pipe, folder_pipe = load_pipeline(path), load_pipeline(folder)
    assert type(file_pipe) is type(folder_pipe)
    assert file_pipe.vae is None and file_pipe.text_encoder is None
    shipped = json.loads((CONFIGS / variant / "scheduler" / "scheduler_config.json").read_text())
    assert type(file_pipe.scheduler).__name__ == shipped["_class_name"]
    assert all(file_pipe.scheduler.config[k] == v for k, v in shipped.items() if not k.startswith("_")
               and v is not None)
    theirs = folder_pipe.transformer.state_dict()
    for key, value in file_pipe.transformer.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    assert theirs.keys() == file_pipe.transformer.state_dict().keys()
    _same_scheduler(file_pipe, folder_pipe, family)
    got, want = _run(file_pipe, family), _run(folder_pipe, family)
    assert torch.isfinite(want).all() and want.abs().max() < 50
    assert (got - want).abs().max() < TOLERANCE, f"{variant}: max diff {(got - want).abs().max():.2e}"


def test_a_qwen_image_edit_2511_file_loads_with_its_timestep_zero_references(checkpoints, tmp_path):
    """Comfy-Org's 2511 file is Qwen-Image's layout with an empty `__index_timestep_zero__` marker: diffusers'
    zero_cond_t; the same file without it loads without (negative control)."""
    from safetensors.torch import load_file

    _, path = checkpoints["qwen-image"]
    marked = tmp_path / "qwen_image_edit_2511.safetensors"
    save_file({**load_file(path), "model.diffusion_model.__index_timestep_zero__": torch.tensor([])}, marked)
    assert detect_checkpoint(marked).overrides["zero_cond_t"] is True
    assert load_pipeline(marked).transformer.config.zero_cond_t is True
    assert load_pipeline(path).transformer.config.zero_cond_t is False


def test_wrong_head_split_is_caught(checkpoints):
    """Negative control: the same weights under another head split give another output, so the 1e-4 check
    above would catch a wrongly derived head count."""
    folder, path = checkpoints["pixart-sigma-1024"]
    pipe = load_pipeline(path)
    _same_scheduler(pipe, load_pipeline(folder), "pixart-sigma")
    good = _run(pipe, "pixart-sigma")
    config = {**pipe.transformer.config, "num_attention_heads": 4, "attention_head_dim": 36}
    wrong = type(pipe.transformer).from_config(config)
    wrong.load_state_dict(pipe.transformer.state_dict())
    pipe.transformer = wrong.eval()
    assert (_run(pipe, "pixart-sigma") - good).abs().max() > 100 * TOLERANCE


def test_pth_checkpoint(checkpoints):
    folder, safetensors_path = checkpoints["pixart-sigma-1024"]
    path = safetensors_path.parent / "PixArt-Sigma-XL-2-1024-MS.pth"
    assert detect_checkpoint(path).variant == "pixart-sigma-1024"
    from_pth, from_safetensors = load_pipeline(path), load_pipeline(safetensors_path)
    theirs = from_safetensors.transformer.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in from_pth.transformer.state_dict().items())


def test_pth_is_never_unpickled_with_code(tmp_path):
    """weights_only=True: a pickle that would run code on load is refused, not run."""
    path = tmp_path / "evil.pth"
    marker = tmp_path / "ran"
    torch.save({"state_dict": _Evil(str(marker))}, path)
    with pytest.raises(ValueError, match="holds more than tensors"):
        detect_checkpoint(path)
    assert not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_whole_checkpoint_prefix(checkpoints, tmp_path):
    """SAI/ComfyUI whole checkpoints keep the transformer under model.diffusion_model. next to VAE and text
    encoders; only the transformer is read."""
    folder, path = checkpoints["sd3.5-large"]
    weights = CheckpointFile(path).state_dict()
    whole = {f"model.diffusion_model.{k}": v for k, v in weights.items()}
    whole["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4)
    whole["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.zeros(4)
    save_file(whole, tmp_path / "sd3.5_large.safetensors")
    pipe = load_pipeline(tmp_path / "sd3.5_large.safetensors")
    theirs = load_pipeline(folder).transformer.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in pipe.transformer.state_dict().items())


def test_stored_dtype_is_kept(checkpoints, tmp_path):
    _, path = checkpoints["flux1-schnell"]
    half = {k: v.to(torch.bfloat16) for k, v in CheckpointFile(path).state_dict().items()}
    save_file(half, tmp_path / "flux1-schnell-bf16.safetensors")
    assert load_pipeline(tmp_path / "flux1-schnell-bf16.safetensors").transformer.dtype == torch.bfloat16
    assert load_pipeline(tmp_path / "flux1-schnell-bf16.safetensors", dtype="fp32").transformer.dtype == torch.float32
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in half.items()}  # plain fp8 storage computes in bf16
    save_file(fp8, tmp_path / "flux1-schnell-fp8.safetensors")
    assert load_pipeline(tmp_path / "flux1-schnell-fp8.safetensors").transformer.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ errors
def test_unknown_checkpoint_lists_supported(tmp_path):
    path = tmp_path / "sd15.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}, path)
    with pytest.raises(ValueError) as error:
        load_pipeline(path)
    message = str(error.value)
    assert str(path) in message and "not a supported single-file transformer checkpoint" in message
    for _, name, _ in supported_variants().values():
        assert name in message


def test_truncated_file(checkpoints, tmp_path):
    _, path = checkpoints["flux1-dev"]
    data = path.read_bytes()
    for cut, name in ((len(data) // 2, "half.safetensors"), (6, "header.safetensors")):
        broken = tmp_path / name
        broken.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="corrupted or truncated") as error:
            load_pipeline(broken)
        assert str(broken) in str(error.value)
    pth = path.parent / "PixArt-Sigma-XL-2-1024-MS.pth"
    (tmp_path / "half.pth").write_bytes(pth.read_bytes()[: pth.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        load_pipeline(tmp_path / "half.pth")
    (tmp_path / "garbage.pth").write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="corrupted or truncated"):
        load_pipeline(tmp_path / "garbage.pth")


def test_missing_file(tmp_path):
    path = tmp_path / "flux1-dev.safetensors"
    with pytest.raises(FileNotFoundError, match="does not exist") as error:
        load_pipeline(path)
    assert str(path) in str(error.value)


def test_incomplete_or_mismatching_weights(checkpoints, tmp_path):
    """A file of a supported layout that lacks a tensor, or whose tensors disagree with each other."""
    _, path = checkpoints["sd3-medium"]
    weights = CheckpointFile(path).state_dict()
    save_file({k: v for k, v in weights.items() if k != "joint_blocks.1.x_block.mlp.fc2.weight"}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="lacks tensor 'joint_blocks.1.x_block.mlp.fc2.weight'"):
        load_pipeline(tmp_path / "a.safetensors")
    bad = dict(weights, **{"joint_blocks.1.x_block.mlp.fc1.weight": torch.zeros(7, 128)})
    save_file(bad, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"does not fit .*of the wrong shape.*transformer_blocks.1.ff.net.0.proj.weight \(7, 128\)"):
        load_pipeline(tmp_path / "b.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("joint_blocks.2.")}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"block indices \[0, 1, 3\]"):
        detect_checkpoint(tmp_path / "c.safetensors")


@pytest.mark.parametrize("per_layer", [False, True], ids=["scaled_fp8", "comfy_quant"])
def test_comfyui_scaled_fp8_reads_as_comfyui_does_and_stays_fp8(checkpoints, tmp_path, per_layer):
    """ComfyUI's fp8_scaled files: the weights are stored · scale, exactly as a plain file of those values;
    the linear layers keep the fp8 bytes (under half the bf16 load), other tensors load in the compute dtype."""
    from parallel.loading.checkpoints.fp8 import Fp8Linear, storage_of

    _, path = checkpoints["flux1-dev"]
    stored, meant = fp8_scaled(CheckpointFile(path).state_dict(), per_layer)
    save_file(stored, tmp_path / "flux1-dev-fp8-scaled.safetensors")
    save_file(meant, tmp_path / "flux1-dev-meant.safetensors")
    assert detect_checkpoint(tmp_path / "flux1-dev-fp8-scaled.safetensors").variant == "flux1-dev"
    kept = load_pipeline(tmp_path / "flux1-dev-fp8-scaled.safetensors", dtype="fp32").transformer
    want = load_pipeline(tmp_path / "flux1-dev-meant.safetensors", dtype="fp32").transformer.state_dict()
    got = {**kept.state_dict(), **{f"{name}.weight": layer.dequantized() for name, layer in kept.named_modules()
                                   if isinstance(layer, Fp8Linear)}}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert isinstance(kept.transformer_blocks[0].attn.to_q, Fp8Linear)  # split from BFL's fused qkv, scale kept
    assert kept.dtype == torch.float32 and storage_of(kept).keys() == {"float8_e4m3fn", "float32"}
    bf16 = load_pipeline(tmp_path / "flux1-dev-meant.safetensors", dtype="bf16").transformer
    unscaled = load_pipeline(tmp_path / "flux1-dev-fp8-scaled.safetensors").transformer  # bf16 compute by default
    assert unscaled.dtype == torch.bfloat16 and storage_of(unscaled).keys() == {"float8_e4m3fn", "bfloat16"}
    assert sum(storage_of(unscaled).values()) <= 0.55 * sum(storage_of(bf16).values())


QUANTIZED = [(variant, kind) for variant in VARIANTS for kind in ("fp8_scaled", "gguf_q8_0")
             if not (kind == "gguf_q8_0" and variant.startswith("pixart"))]  # diffusers loads no PixArt GGUF


@pytest.mark.parametrize("variant, kind", QUANTIZED, ids=[f"{v}-{k}" for v, k in QUANTIZED])
def test_quantized_files_of_every_family_equal_their_dequantized_weights(checkpoints, tmp_path, variant, kind):
    """Every family's file as ComfyUI's scaled fp8 and as city96's Q8_0 GGUF: kept quantized, and sampling equal
    to a plain file of the weights it means; the quantization is real (the original weights differ)."""
    from parallel.loading.checkpoints.fp8 import storage_of

    from quantized_files import gguf_file

    family, _ = VARIANTS[variant]
    _, path = checkpoints[variant]
    weights = CheckpointFile(path).state_dict()
    quantized = tmp_path / (f"{variant}.gguf" if kind == "gguf_q8_0" else f"{variant}-fp8_scaled.safetensors")
    if kind == "gguf_q8_0":
        meant = gguf_file(weights, quantized, family, as_diffusers=True)
    else:
        stored, meant = fp8_scaled(weights, per_layer=False)
        save_file(stored, quantized)
    save_file({k: v.contiguous() for k, v in meant.items()}, tmp_path / f"{variant}-meant.safetensors")
    pipe = load_pipeline(quantized, dtype="fp32")
    assert {"Q8_0", "float8_e4m3fn"} & storage_of(pipe.transformer).keys()
    plain = load_pipeline(tmp_path / f"{variant}-meant.safetensors", dtype="fp32")
    _same_scheduler(pipe, plain, family)
    got, want = _run(pipe, family), _run(plain, family)
    assert (got - want).abs().max() < TOLERANCE
    original = load_pipeline(path, dtype="fp32")
    _same_scheduler(original, plain, family)
    assert (_run(original, family) - got).abs().max() > TOLERANCE  # the quantization is real


def test_quantized_formats_this_pack_does_not_read_are_refused(checkpoints, tmp_path):
    _, path = checkpoints["flux1-dev"]
    stored, _ = fp8_scaled(CheckpointFile(path).state_dict(), per_layer=True)
    stored["img_in.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    save_file(stored, tmp_path / "flux1-dev-nvfp4.safetensors")
    with pytest.raises(ValueError, match="layer img_in is stored as 'nvfp4', a format this pack does not read"):
        load_pipeline(tmp_path / "flux1-dev-nvfp4.safetensors")
    stored["img_in.comfy_quant"] = stored["txt_in.comfy_quant"].clone()
    del stored["img_in.weight_scale"]
    save_file(stored, tmp_path / "flux1-dev-no-scale.safetensors")
    with pytest.raises(ValueError, match="layer img_in is float8_e4m3fn but has no img_in.weight_scale"):
        load_pipeline(tmp_path / "flux1-dev-no-scale.safetensors")
    weights = dict(CheckpointFile(path).state_dict(), **{"img_in.weight.absmax": torch.ones(1)})
    save_file(weights, tmp_path / "flux1-dev-nf4.safetensors")
    with pytest.raises(ValueError, match="bitsandbytes-quantized checkpoint"):
        load_pipeline(tmp_path / "flux1-dev-nf4.safetensors")


@pytest.mark.parametrize("variant", VARIANTS)
def test_broken_scaled_fp8_files_are_refused_in_one_line_in_every_layout(checkpoints, tmp_path, variant):
    """A scaled fp8 file missing one layer's scale_weight would load that layer unscaled (thousands of times too
    large); one missing a comfy_quant layer's weight_scale, one whose marker has no scales, and one with scales but no
    marker would load wrong too: each is refused in one line naming the file and the tensor."""
    _, path = checkpoints[variant]
    weights = CheckpointFile(path).state_dict()
    stored, _ = fp8_scaled(weights, per_layer=False)
    marker = next(k for k in stored if k.endswith("scaled_fp8"))
    layer = sorted(k.removesuffix(".scale_weight") for k in stored if k.endswith(".scale_weight"))[-1]
    per_layer, _ = fp8_scaled(weights, per_layer=True)
    broken = {
        f"tensor {layer}.weight is fp8 in a scaled_fp8 file but has no {layer}.scale_weight":
            {k: v for k, v in stored.items() if k != f"{layer}.scale_weight"},
        f"layer {layer} is float8_e4m3fn but has no {layer}.weight_scale":
            {k: v for k, v in per_layer.items() if k != f"{layer}.weight_scale"},
        "marked scaled_fp8 but holds no tensor \\*.scale_weight":
            {k: v for k, v in stored.items() if not k.endswith(".scale_weight")},
        "scales an fp8 weight, but the file has no scaled_fp8 marker": {k: v for k, v in stored.items() if k != marker},
    }
    for n, (message, tensors) in enumerate(broken.items()):
        file = tmp_path / f"{variant}-broken{n}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, file)
        with pytest.raises(ValueError) as refused:
            load_pipeline(file)
        text = str(refused.value)
        assert len(text.splitlines()) == 1 and text.startswith(f"{file}: ") and re.search(message, text), text


def test_text_encoders_refused(checkpoints):
    _, path = checkpoints["flux1-dev"]
    with pytest.raises(ValueError, match="no text encoders"):
        load_pipeline(path, text_encoders=True)


def test_shipped_configs_are_complete():
    for variant in supported_variants():
        for part in ("model_index.json", "transformer/config.json", "scheduler/scheduler_config.json"):
            assert json.loads((CONFIGS / variant / part).read_text()), f"{variant}/{part}"


# ------------------------------------------------------------------------------------ xDiT Pool's model list
def _pool_node_module(monkeypatch, folders: dict[str, list]):
    """nodes/pool_node.py against stand-ins for ComfyUI's folder_paths and comfy_api (not installed here),
    without running nodes/__init__.py (which registers routes on a ComfyUI server)."""
    fake_folders = types.ModuleType("folder_paths")
    fake_folders.get_folder_paths = lambda name: [str(p) for p in folders.get(name, [])]

    def files(name):
        return sorted(str(f.relative_to(root)) for root in folders.get(name, []) for f in root.rglob("*") if f.is_file())

    def full_path(name, filename):
        return next((str(root / filename) for root in folders.get(name, []) if (root / filename).is_file()), None)

    fake_folders.get_filename_list, fake_folders.get_full_path = files, full_path
    latest = types.ModuleType("comfy_api.latest")
    latest.io = types.SimpleNamespace(Custom=lambda name: name, ComfyNode=object)
    return import_node_module(monkeypatch, "pool_node", {"folder_paths": fake_folders, "comfy_api": types.ModuleType("comfy_api"),
                                                        "comfy_api.latest": latest})


def test_pool_node_lists_single_files(checkpoints, tmp_path, monkeypatch):
    unet, diffusion_models, ckpts = tmp_path / "unet", tmp_path / "diffusion_models", tmp_path / "checkpoints"
    vaes = tmp_path / "vae"
    for folder in (unet, diffusion_models / "flux", ckpts, vaes):
        folder.mkdir(parents=True)
    save_file({"conv2.weight": torch.zeros(1)}, vaes / "wan_2.1_vae.safetensors")
    shutil.copy(checkpoints["flux1-dev"][1], diffusion_models / "flux" / "flux1-dev.safetensors")
    shutil.copy(checkpoints["pixart-sigma-1024"][1].parent / "PixArt-Sigma-XL-2-1024-MS.pth", unet)
    shutil.copy(checkpoints["sd3.5-large"][1], ckpts / "sd3.5_large.safetensors")
    save_file({"input_blocks.0.0.weight": torch.zeros(1)}, ckpts / "v1-5-pruned.safetensors")  # not a DiT: not listed
    (ckpts / "notes.txt").write_text("not a checkpoint")
    node = _pool_node_module(monkeypatch, {"diffusion_models": [unet, diffusion_models], "checkpoints": [ckpts],
                                           "vae": [vaes]})
    files = [m for m in node.diffusers_models() if m.startswith(node.FILE_PREFIX)]
    assert files == ["file: diffusion_models/PixArt-Sigma-XL-2-1024-MS.pth",
                     "file: diffusion_models/flux/flux1-dev.safetensors", "file: checkpoints/sd3.5_large.safetensors"]
    assert node.model_path(files[1]) == str(diffusion_models / "flux" / "flux1-dev.safetensors")
    assert detect_checkpoint(node.model_path(files[2])).variant == "sd3.5-large"
    with pytest.raises(ValueError, match="no file 'gone.safetensors'"):
        node.model_path("file: checkpoints/gone.safetensors")
    kwargs = {"model": files[1], "nproc": 2, "dp_degree": 1, "cfg_parallel": False, "pipefusion_degree": 1,
              "ring_degree": 1, "ulysses_degree": 2, "num_patches": 0, "warmup_steps": 1, "text_encoders": True,
              "dtype": "auto", "devices": "", "threads_per_rank": 0, "endpoint": ""}
    key = node.pool_key(kwargs)
    assert key.model == node.model_path(files[1]) and not key.text_encoders  # a file has no text encoders
    assert key.vae is None and node.vae_files() == ["none", "wan_2.1_vae.safetensors"]
    assert node.pool_key({**kwargs, "vae": "wan_2.1_vae.safetensors"}).vae == str(vaes / "wan_2.1_vae.safetensors")
    with pytest.raises(ValueError, match="goes with a single-file model .* set vae to none"):
        node.pool_key({**kwargs, "model": "xdit-tiny-flux", "vae": "wan_2.1_vae.safetensors"})


# --------------------------------------------------------------------------------------- engine (torchrun)
@pytest.mark.parametrize("variant", ["flux1-dev", "wan2.1-t2v-1.3b", "z-image"])
def test_engine_takes_a_file(checkpoints, tmp_path, variant):
    """Contract E with --model FILE on 2 ranks (Ulysses 2) equals the single-process file pipeline."""
    family, _ = VARIANTS[variant]
    _, path = checkpoints[variant]
    video = ["--num-frames", "5"] if family in tiny_models.VIDEO_FAMILIES else []
    inputs = tiny_models.make_inputs(family, **({"num_frames": 5} if video else {}))
    save_file(inputs, tmp_path / "in.safetensors")
    result = torchrun(2, "-m", "parallel.run", "--model", str(path), "--inputs", str(tmp_path / "in.safetensors"),
                      "--output", str(tmp_path / "out.safetensors"), "--steps", "4", "--guidance-scale",
                      str(tiny_models.MODELS[family].guidance), "--height", "64", "--width", "64", "--ulysses-degree", "2",
                      *video)
    assert result.returncode == 0, result.stderr[-3000:]
    from safetensors.torch import load_file

    want = _run(load_pipeline(path), family)
    got = load_file(tmp_path / "out.safetensors")["latents"]
    assert (got - want).abs().max() < TOLERANCE
