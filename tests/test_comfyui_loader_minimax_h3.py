"""MiniMax-H3 under Load Diffusion Model (xDiT Pool) in a real ComfyUI 0.33: the sampling part of the official
video_minimax_h3_t2v template (BasicScheduler simple, KSamplerSelect res_multistep, BasicGuider, RandomNoise,
SamplerCustomAdvanced; the model sampling of ComfyUI's MiniMaxH3 class: shift 12, audio shift 3) with UNETLoader
swapped for the loader on Ulysses 2 gives what ComfyUI's own model gives on the same file, video and audio.

The file is a tiny transformer written from ComfyUI's own MiniMaxH3Model (random weights of a fixed seed, its q/k
norms around 2 so attention is peaked and a misplaced row shows) in the layout Comfy-Org publishes; ComfyUI's
UNETLoader detects it as MiniMaxH3, the pool loads it with diffusers' converter. ComfyUI's model call differs from
the pipeline's transformer call in what a mapping of inputs covers: it takes the sampler's audio carried on the video
schedule (undone around the call: nodes/av_calls.py), derives the audio's sigma from the video's, packs [text | audio |
video] itself and returns minus the transformer's velocity. The conditioning is the text encoder's hidden states with
their modality tags (`minimax_token_tags`), through XDiTTestConditioning (Qwen3-VL 32B is too big for a CPU test).

video_minimax_h3_i2v's sampling part is the same with MiniMaxH3ImageToVideo's conditioning: a first frame's encoded
latent in `minimax_keyframes`, which ComfyUI's model noises from the sampler's seed and puts in front of the video rows;
the loader sends it noised the same way (nodes/av_calls.py) and the pool's call places it as the pipeline's fl2va does.

video_minimax_h3_r2v's sampling part is the same with MiniMaxH3ReferenceToVideo's conditioning (`minimax_refs`: an
image, a video with its soundtrack, an audio clip). ComfyUI runs references on the one file UNETLoader loaded (the
template's is minimax_h3_ref2va_*, other weights than the t2v/i2v file, and in the curve form:
test_comfyui_loader_minimax_h3_curve); the loader sends
them in ref2va's wire form, their image and video noised as ComfyUI's model noises them, and a pool of that one file
runs them on its transformer (a diffusers directory's pool on its `transformer_ref`: test_minimax_h3).

Model from xDiT Pool on an xDiT Pool of the same file takes the same calls through the same nodes/av_calls.py, its
ComfyUI model class from the pool (not from the file): the same sampling part, and the i2v one with ModelSamplingMiniMaxH3
moving the audio shift, equal ComfyUI's own model too.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_comfyui import saved_latent
from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE, one_rank

COMFY_ARGS = ("--use-pytorch-cross-attention",)  # ComfyUI's attention as on the GPUs a pool runs on (SDPA)
FILE = "tiny-minimax-h3-comfy.safetensors"
TEXT_TOKENS, TEXT_WIDTH, SIZE, LENGTH, STEPS = 7, 32, 64, 22, 4  # 22 frames: 7 latent frames, 37 audio latents
# ComfyUI's MiniMaxH3Model keywords for the tiny file (the released model: 5376 wide, 50 blocks, head 128)
CONFIG = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4, attention_head_dim=16,
              ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32, text_dim=TEXT_WIDTH, timestep_input_dim=32,
              time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=2)

# Writes the file (unless one is there: the same weights quantized) from ComfyUI's own MiniMaxH3Model (its rotary
# frequencies as the released file's: theta 10000), loads it with UNETLoader's own function and, given inputs, evaluates ComfyUI's diffusion model call on the unpacked
# [video, audio] at the video's sigma × 1000, with the tags and the sampler's audio scale in its payload, and the
# audio's sigma ComfyUI's model derives from the video's (its shifts 12 and 3).
COMFY_SCRIPT = """
import json, os, sys
path, inputs, result, config = sys.argv[1:5]
sys.argv = sys.argv[:1] + ["--cpu", "--use-pytorch-cross-attention"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.ops, comfy.sd
from safetensors.torch import load_file, save_file
from comfy.ldm.minimax.model import MiniMaxH3Model, time_shift_sigma, unpatchify_video
config = json.loads(config)
model = MiniMaxH3Model(**config, operations=comfy.ops.disable_weight_init, device="meta")
generator = torch.Generator().manual_seed(0)
weights = {name: torch.randn(value.shape, generator=generator) * 0.2 + (2.0 if name.endswith("_norm.weight") else 0.0)
           for name, value in model.state_dict().items()}
rotary = config["rope_inv_freq_len"]
weights["rope.inv_freq"] = 1.0 / 10000.0 ** (torch.arange(0, 2 * rotary, 2, dtype=torch.float32) / (2 * rotary))
if not os.path.exists(path):  # a file there already (the same weights quantized): ComfyUI's model call on it
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()}, path)
if inputs:
    patcher = comfy.sd.load_diffusion_model(path)
    x = load_file(inputs)
    payload, out = {"text_token_tags": x["tags"], "audio_scale": 1.0}, {}
    if "keyframes" in x:  # fl2va: a first and a last frame of 22 (7 latent frames), noised by its model from seed 5
        frames = [{"resolved_frame_index": i, "latent": x["keyframes"][:, :, j:j + 1]} for j, i in enumerate((0, 21))]
        payload.update(keyframes=frames, frame_count=22, seed=5, cond_video_latents=[f["latent"] for f in frames])
        rows = patcher.model.diffusion_model._cond_video_rows(payload, "cpu").chunk(2)
        out["noised"] = torch.cat([unpatchify_video(r, 1, *(n // 2 for n in x["video"].shape[3:])) for r in rows], 2)
    if "image" in x:  # ref2va: an image, a video with its soundtrack and an audio clip, as MiniMaxH3ReferenceToVideo's
        refs = [{"kind": "image", "latent_h": 4, "latent_w": 4, "latent": x["image"]},
                {"kind": "video_audio", "latent_t": 2, "latent_h": 4, "latent_w": 6, "ref_audio_t": 5,
                 "latent": x["refvideo"], "audio_latent": x["soundtrack"]},
                {"kind": "audio", "ref_audio_t": 3, "audio_latent": x["refaudio"]}]
        payload.update(refs=refs, seed=5, cond_video_latents=[x["image"], x["refvideo"]],
                       cond_audio_latents=[x["soundtrack"], x["refaudio"]])
        out["noised_rows"] = patcher.model.diffusion_model._cond_video_rows(payload, "cpu")
    with torch.no_grad():
        video, audio = patcher.model.diffusion_model([x["video"], x["audio"]], x["sigma"] * 1000, x["context"],
                                                     minimax_payload=payload)
    save_file({**out, "video": video.contiguous(), "audio": audio.contiguous(),
               "audio_sigma": time_shift_sigma(x["sigma"], 12.0, 3.0)}, result,
              metadata={"model": type(patcher.model).__name__,
                        "curve": str(patcher.model.diffusion_model.use_adaln_curves)})
"""


def _comfyui_file(python, comfyui, path, work=None, keyframes=False, refs=False, config=CONFIG) -> tuple[dict, str] | None:
    """The file written at `path` by ComfyUI's own code from its MiniMaxH3Model of `config`; with `work`, ComfyUI's
    model call on it too: the inputs and its outputs (with `keyframes`, two of them in its payload, and them noised as
    its model noises them), and the model class ComfyUI detected."""
    if work is None:
        subprocess.run([str(python), "-c", COMFY_SCRIPT, str(path), "", "", json.dumps(config)], cwd=comfyui,
                       check=True, capture_output=True)
        return None
    gen = torch.Generator().manual_seed(1)
    tags = torch.ones(TEXT_TOKENS, dtype=torch.long)
    tags[2:4] = 0  # two vision rows among the text, as a keyframe's tokens are tagged
    inputs = {"video": torch.randn(1, 24, 7, 4, 6, generator=gen), "audio": torch.randn(1, 32, 2, 23, generator=gen),
              "context": torch.randn(1, TEXT_TOKENS, TEXT_WIDTH, generator=gen), "sigma": torch.tensor([0.7]), "tags": tags}
    if keyframes:
        inputs["keyframes"] = torch.randn(1, 24, 2, 4, 6, generator=gen)
    if refs:
        inputs.update(image=torch.randn(1, 24, 1, 4, 4, generator=gen), refvideo=torch.randn(1, 24, 2, 4, 6, generator=gen),
                      soundtrack=torch.randn(1, 32, 2, 5, generator=gen), refaudio=torch.randn(1, 32, 2, 3, generator=gen))
    save_file(inputs, work / "inputs.safetensors")
    subprocess.run([str(python), "-c", COMFY_SCRIPT, str(path), str(work / "inputs.safetensors"),
                    str(work / "result.safetensors"), json.dumps(config)], cwd=comfyui, check=True, capture_output=True)
    with safe_open(work / "result.safetensors", "pt") as f:
        model = f.metadata()["model"] + (" curve form" if f.metadata()["curve"] == "True" else "")
    return {**inputs, **{f"comfy_{k}": v for k, v in load_file(work / "result.safetensors").items()}}, model


def _pool_call(path, x: dict, audio_sigma: torch.Tensor, anchors=None, refs=None, dtype=None) -> dict[str, torch.Tensor]:
    """The engine's model call on the file as a pool loads it (one rank; `dtype` None: as stored): ComfyUI's streams
    in the pipeline's layout; with `anchors`, ComfyUI's noised keyframes as the loader sends them."""
    from parallel.layout.config import ParallelConfig
    from parallel.loading.checkpoints.load import load_single_file_pipeline
    from parallel.model_executor.model_call import check_model_call, evaluate
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper

    tensors = {"latents": x["video"], "sigma": x["sigma"], "prompt_embeds": x["context"],
               "text_token_tags": x["tags"][None], "audio_latents": x["audio"].permute(0, 2, 1, 3),
               "audio_sigma": audio_sigma}
    if anchors is not None:
        tensors.update(condition_latents=x["comfy_noised"].flatten(2), keyframe_anchors=torch.tensor([anchors]),
                       condition_sizes=torch.tensor([[[1.0, 4, 6]] * len(anchors)]))
    if refs is not None:
        tensors.update(refs)
    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(load_single_file_pipeline(path, dtype=dtype))
        check_model_call(wrapper, tensors)
        out = evaluate(wrapper, tensors)
        wrapper.unwrap()
    return {"video": out["prediction"], "audio": out["audio"].permute(0, 2, 1, 3)}


def test_comfyuis_minimax_h3_model_call_equals_the_pools_on_the_same_file(comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    x, model = _comfyui_file(python, comfyui, tmp_path / FILE, tmp_path)
    assert model == "MiniMaxH3"  # UNETLoader's own detection of the file
    ours = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"])
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the audio at the video's sigma (no shift) moves the audio far beyond the tolerance
    unshifted = _pool_call(tmp_path / FILE, x, x["sigma"])
    assert (unshifted["audio"] - x["comfy_audio"]).abs().max().item() > 1e-2


def test_comfyuis_model_call_with_a_first_and_a_last_keyframe_equals_the_pools(comfyui_install, tmp_path):
    """fl2va's rows: ComfyUI's model's keyframes (in front of the video, at the first and the last frame's time, held
    at t = 0.999) are the pool's from the same noised latents."""
    comfyui, python = comfyui_install
    x, _ = _comfyui_file(python, comfyui, tmp_path / FILE, tmp_path, keyframes=True)
    ours = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"], anchors=[0.0, 1.0])
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the two keyframes' anchors swapped
    swapped = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"], anchors=[1.0, 0.0])
    assert (swapped["video"] - x["comfy_video"]).abs().max().item() > 1e-2


def _reference_wire(x: dict, swapped: bool = False) -> dict[str, torch.Tensor]:
    """ComfyUI's references in ref2va's wire form, as nodes/av_calls.py sends them: its noised image and video rows
    back as latents, the soundtrack and the audio clip as its model packs them (channel-major rows, clean); with
    `swapped`, the image and the video in the other order."""
    from parallel.families.minimax_h3.pipelines import unpatchify_video_rows

    rows = x["comfy_noised_rows"]
    visuals = [unpatchify_video_rows(rows[:4], (1, 24, 1, 4, 4), (1, 2, 2)),
               unpatchify_video_rows(rows[4:], (1, 24, 2, 4, 6), (1, 2, 2))]
    kinds, sizes = [0.0, 2.0, 3.0], [[1.0, 4, 4], [2.0, 4, 6]]
    if swapped:
        visuals, kinds, sizes = visuals[::-1], [2.0, 0.0, 3.0], sizes[::-1]
    sounds = [x[name][0].permute(1, 2, 0).reshape(-1, 32).T for name in ("soundtrack", "refaudio")]
    return {"reference_kinds": torch.tensor([kinds]), "condition_latents": torch.cat([v.flatten(2) for v in visuals], 2),
            "condition_sizes": torch.tensor([sizes]), "audio_condition_latents": torch.cat(sounds, 1)[None],
            "audio_condition_sizes": torch.tensor([[[10.0], [6.0]]])}


def test_comfyuis_model_call_with_references_equals_the_pools(comfyui_install, tmp_path):
    """ref2va's rows: ComfyUI's model's references (MiniMaxH3ReferenceToVideo's blocks: an image, a video with its
    soundtrack, an audio clip), run on the one file it loaded, are the pool's from the same noised latents."""
    comfyui, python = comfyui_install
    x, _ = _comfyui_file(python, comfyui, tmp_path / FILE, tmp_path, refs=True)
    ours = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"], refs=_reference_wire(x))
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the image and the video reference in the other order
    swapped = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"], refs=_reference_wire(x, swapped=True))
    assert (swapped["video"] - x["comfy_video"]).abs().max().item() > 1e-2


def _template(unet: dict, seed: int, text: str = "h3-text.safetensors") -> dict:
    """video_minimax_h3_t2v's sampling part at a tiny size, its latent split and saved per stream (the i2v template's
    too: its MiniMaxH3ImageToVideo gives the same empty latent and the conditioning `text` holds)."""
    return {
        "unet": unet,
        "text": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": text}},
        "latent": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": SIZE, "height": SIZE, "length": LENGTH}},
        "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["unet", 0], "scheduler": "simple",
                                                             "steps": STEPS, "denoise": 1.0}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
        "guider": {"class_type": "BasicGuider", "inputs": {"model": ["unet", 0], "conditioning": ["text", 0]}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "sample": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sample", 0]}},
        "save-video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "h3v"}},
        "save-audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "h3a"}},
    }


def _streams(comfy, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    entry = comfy.wait(comfy.queue(prompt), 600)
    errors = [(m[1]["node_type"], m[1]["exception_message"], m[1]["traceback"][-3:])
              for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors or json.dumps(entry["status"])[-2000:]
    return saved_latent(comfy, entry, "save-video"), saved_latent(comfy, entry, "save-audio")


def _text(comfy) -> dict[str, torch.Tensor]:
    """The tiny file in ComfyUI's models and the text encoder's output for it, saved as h3-text.safetensors."""
    _comfyui_file(comfy.python, comfy.comfy, comfy.work / "models" / "diffusion_models" / FILE)
    gen = torch.Generator().manual_seed(3)
    tags = torch.ones(TEXT_TOKENS, dtype=torch.long)
    tags[:2] = 0
    text = {"cond": torch.randn(1, TEXT_TOKENS, TEXT_WIDTH, generator=gen), "minimax_token_tags": tags}
    save_file(text, comfy.work / "input" / "h3-text.safetensors")
    return text


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_minimax_h3(comfy):
    _text(comfy)
    spec = comfy.get("/object_info/XDiTLoadDiffusionModel")["XDiTLoadDiffusionModel"]["input"]["required"]["unet_name"]
    assert FILE in (spec[1]["options"] if spec[0] == "COMBO" else spec[0])  # the loader offers the file
    stock = _streams(comfy, _template({"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                                             "weight_dtype": "default"}}, seed=1))
    loader = _loader(ulysses_degree=2)
    swapped = _streams(comfy, _template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=1))
    assert stock[0].shape == (1, 24, 7, SIZE // 16, SIZE // 16) and stock[1].shape == (1, 32, 2, 37)
    diffs = [(ours - theirs).abs().max().item() for ours, theirs in zip(swapped, stock)]
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model from another seed's noise is far from the pool's result
    other = _streams(comfy, _template({"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                                             "weight_dtype": "default"}}, seed=2))
    assert min((ours - theirs).abs().max().item() for ours, theirs in zip(swapped, other)) > 1e-2


def _keyframe(comfy, text: dict, name: str, frame: int) -> str:
    """MiniMaxH3ImageToVideo's conditioning with one keyframe at pixel `frame`: the text, `minimax_keyframes` (the
    encoded image, one latent frame) and `minimax_frame_count`, saved as `name` (its VAE is too big for a CPU test)."""
    latent = torch.randn(1, 24, 1, SIZE // 16, SIZE // 16, generator=torch.Generator().manual_seed(4))
    save_file({**text, "minimax_keyframes.0.latent": latent, "minimax_keyframes.0.resolved_frame_index":
               torch.tensor(frame), "minimax_frame_count": torch.tensor(LENGTH)}, comfy.work / "input" / name)
    return name


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_minimax_h3_from_a_first_frame(comfy):
    """video_minimax_h3_i2v's sampling part (fl2va: a first frame) with UNETLoader swapped: the keyframe, noised as
    ComfyUI's model noises it from the sampler's seed, reaches the pool's model call in front of the video rows."""
    text = _text(comfy)
    first, last = _keyframe(comfy, text, "h3-first.safetensors", 0), _keyframe(comfy, text, "h3-last.safetensors",
                                                                                 LENGTH - 1)
    stock_unet = {"class_type": "UNETLoader", "inputs": {"unet_name": FILE, "weight_dtype": "default"}}
    stock = _streams(comfy, _template(stock_unet, seed=1, text=first))
    loader = _loader(ulysses_degree=2)
    swapped = _streams(comfy, _template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=1,
                                        text=first))
    diffs = [(ours - theirs).abs().max().item() for ours, theirs in zip(swapped, stock)]
    assert max(diffs) <= TOLERANCE, diffs
    # negative controls: ComfyUI's own model with the keyframe dropped, or moved to the last frame, is far from it
    for control in ("h3-text.safetensors", last):
        other = _streams(comfy, _template(stock_unet, seed=1, text=control))
        assert min((ours - theirs).abs().max().item() for ours, theirs in zip(swapped, other)) > 1e-2, control


def _references(comfy, text: dict, name: str, swapped: bool = False) -> str:
    """MiniMaxH3ReferenceToVideo's conditioning, saved as `name`: the text and its `minimax_refs` (an image, a video with
    its soundtrack, an audio clip: the blocks it builds, their latents encoded; its VAEs are too big for a CPU test);
    with `swapped`, the image and the video in the other order."""
    gen = torch.Generator().manual_seed(6)
    image, video = torch.randn(1, 24, 1, 4, 4, generator=gen), torch.randn(1, 24, 2, 4, 6, generator=gen)
    soundtrack, clip = torch.randn(1, 32, 2, 5, generator=gen), torch.randn(1, 32, 2, 3, generator=gen)
    refs = [({"kind": "image"}, {"latent_h": 4, "latent_w": 4, "latent": image}),
            ({"kind": "video_audio"}, {"latent_t": 2, "latent_h": 4, "latent_w": 6, "ref_audio_t": 5, "latent": video,
                                       "audio_latent": soundtrack}),
            ({"kind": "audio"}, {"ref_audio_t": 3, "audio_latent": clip})]
    refs = [refs[1], refs[0], refs[2]] if swapped else refs
    tensors = {f"minimax_refs.{i}.{k}": v if isinstance(v, torch.Tensor) else torch.tensor(v)
               for i, (_, fields) in enumerate(refs) for k, v in fields.items()}
    kinds = {f"minimax_refs.{i}.kind": kind["kind"] for i, (kind, _) in enumerate(refs)}
    save_file({**text, **tensors}, comfy.work / "input" / name, metadata=kinds)
    return name


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_minimax_h3_from_references(comfy):
    """video_minimax_h3_r2v's sampling part (ref2va: MiniMaxH3ReferenceToVideo's image, video with its soundtrack and
    audio clip) with UNETLoader swapped: the references, their image and video noised as ComfyUI's model noises them
    from the sampler's seed, reach the pool's model call in ref2va's layout, run on the one file both loaded."""
    text = _text(comfy)
    refs = _references(comfy, text, "h3-refs.safetensors")
    swapped_refs = _references(comfy, text, "h3-refs-swapped.safetensors", swapped=True)
    stock = _streams(comfy, _template(STOCK_UNET, seed=1, text=refs))
    loader = _loader(ulysses_degree=2)
    ours = _streams(comfy, _template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=1, text=refs))
    diffs = _max_diffs(ours, stock)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model with the image and the video reference in the other order
    assert min(_max_diffs(ours, _streams(comfy, _template(STOCK_UNET, seed=1, text=swapped_refs)))) > 1e-2


def _pool_model(layout: dict) -> dict:
    """xDiT Pool serving the tiny file (its transformer alone: the conditioning comes from ComfyUI) and Model from xDiT
    Pool on it, as the nodes `pool` and `unet` of a prompt."""
    return {"pool": {"class_type": "XDiTPool", "inputs": {
        "model": f"file: diffusion_models/{FILE}", "nproc": 2, "ulysses_degree": 1, "ring_degree": 1,
        "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
        "text_encoders": False, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": "", **layout}},
        "unet": {"class_type": "XDiTModel", "inputs": {"pool": ["pool", 0]}}}


def _shifted(prompt: dict, audio: float) -> dict:
    """The prompt with ModelSamplingMiniMaxH3 between its model and the sampler's nodes: the video shift the
    template's (12), the audio shift `audio` (the model's own sampling moved, and the shifts in its call's options)."""
    shift = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["unet", 0], "shift_video": 12.0,
                                                              "shift_audio": audio}}
    for node in ("sigmas", "guider"):
        prompt[node] = {**prompt[node], "inputs": {**prompt[node]["inputs"], "model": ["shift", 0]}}
    return {**prompt, "shift": shift}


def _max_diffs(ours, theirs) -> list[float]:
    return [(mine - stock).abs().max().item() for mine, stock in zip(ours, theirs)]


STOCK_UNET = {"class_type": "UNETLoader", "inputs": {"unet_name": FILE, "weight_dtype": "default"}}


def test_model_from_an_xdit_pool_of_the_file_on_ulysses_2_equals_comfyuis_own_minimax_h3(comfy):
    """The template's sampling part on Model from xDiT Pool: a pool of the single file (its ComfyUI model class from the
    pool's status, not from the file) takes ComfyUI's [video, audio] calls as the loader's MODEL does."""
    _text(comfy)
    stock = _streams(comfy, _template(STOCK_UNET, seed=1))
    nodes = _pool_model({"ulysses_degree": 2})
    ours = _streams(comfy, {**_template(nodes["unet"], seed=1), "pool": nodes["pool"]})
    diffs = _max_diffs(ours, stock)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model from another seed's noise is far from the pool's result
    assert min(_max_diffs(ours, _streams(comfy, _template(STOCK_UNET, seed=2)))) > 1e-2


def test_model_from_an_xdit_pool_with_a_first_frame_and_another_audio_shift_equals_comfyuis_own(comfy):
    """The i2v template's first frame, and ModelSamplingMiniMaxH3 with the audio shift 5: the shifts reach the pool's
    call from the sampler's options, the keyframe noised from the sampler's seed, as for ComfyUI's own model."""
    first = _keyframe(comfy, _text(comfy), "h3-first.safetensors", 0)
    stock = _streams(comfy, _shifted(_template(STOCK_UNET, seed=1, text=first), audio=5.0))
    nodes = _pool_model({"ulysses_degree": 2})
    ours = _streams(comfy, {**_shifted(_template(nodes["unet"], seed=1, text=first), audio=5.0), "pool": nodes["pool"]})
    diffs = _max_diffs(ours, stock)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model at the template's audio shift (3) is far from it in the audio
    assert _max_diffs(ours, _streams(comfy, _shifted(_template(STOCK_UNET, seed=1, text=first), audio=3.0)))[1] > 1e-2
