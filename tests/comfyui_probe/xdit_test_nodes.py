"""Test-only ComfyUI nodes (tests/comfyui_server.py loads them beside the pack; users never see them).

ComfyUI's own text encoders are built at their released, multi-billion-parameter shapes (Qwen2.5-VL 7B for
`qwen_image` and `hunyuan_video_15`, Qwen3 4B for `lumina2` / Z-Image and FLUX.2 [klein], Mistral 3 for FLUX.2
[dev], UMT5-XXL for `wan`), which a CPU test cannot run. What they hand the sampling part of a workflow is a
CONDITIONING: XDiTTestConditioning builds one from tensors a test saved, in exactly the layout the encoder node
gives (its `cond`, and its extras under their ComfyUI keys: `attention_mask`, `conditioning_byt5small`,
`reference_latents` as TextEncodeQwenImageEdit(Plus) appends them, ...). XDiTTestClipVision stands for
CLIPVisionEncode's output the same way, XDiTTestLatent a latent node's LATENT; XDiTTestSaveAudio and XDiTTestSaveImage
keep an AUDIO and an IMAGE exactly. XDiTTestTextEncoder and XDiTTestVAE stand in for a whole template's CLIPLoader /
DualCLIPLoader and VAELoader (what CLIPTextEncode and TextGenerate, VAEDecode and WanImageToVideo call on them), so an
official workflow runs unchanged otherwise (tests/test_comfyui_browser_loader.py).

A file holds `cond` and extras by key; a list (reference_latents) as `key.0`, `key.1`, ...; a list of dicts
(MiniMaxH3ImageToVideo's `minimax_keyframes`) as `key.0.field`, ...; a number (guidance, a frame index) as a 0-d tensor;
a string field (MiniMaxH3ReferenceToVideo's `minimax_refs.0.kind`) in the file's metadata under its key.
"""

import json
import os

import comfy.clip_vision
import folder_paths
from safetensors import safe_open
from safetensors.torch import load_file


def _load(name: str) -> dict:
    return load_file(os.path.join(folder_paths.get_input_directory(), name))


class XDiTTestConditioning:
    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensors": ("STRING", {"default": ""})}}

    def load(self, tensors):
        saved = _load(tensors)
        with safe_open(os.path.join(folder_paths.get_input_directory(), tensors), "pt") as f:
            strings = {key: value for key, value in (f.metadata() or {}).items() if key.count(".") == 2}
        extras, lists, records = {}, {}, {}
        for key, value in {**saved, **strings}.items():
            if key == "cond":
                continue
            parts = key.split(".")
            if len(parts) == 3 and parts[1].isdigit():
                records.setdefault(parts[0], {}).setdefault(int(parts[1]), {})[parts[2]] = \
                    value if isinstance(value, str) else value.item() if value.ndim == 0 else value
            elif key.rsplit(".", 1)[-1].isdigit():
                name, index = key.rsplit(".", 1)
                lists.setdefault(name, {})[int(index)] = value
            else:
                extras[key] = value.item() if value.ndim == 0 else value
        for name, items in {**lists, **records}.items():
            extras[name] = [items[i] for i in sorted(items)]
        return ([[saved["cond"], extras]],)


class XDiTTestClipVision:
    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("CLIP_VISION_OUTPUT",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensors": ("STRING", {"default": ""})}}

    def load(self, tensors):
        output = comfy.clip_vision.Output()
        for key, value in _load(tensors).items():
            output[key] = value
        return (output,)


class XDiTTestLatent:
    """A LATENT as a latent node that needs a released-size VAE makes it (Wan22ImageToVideoLatent: the Wan 2.2 VAE is
    built at width 160): `samples`, and its `noise_mask` where the file has one."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensors": ("STRING", {"default": ""})}}

    def load(self, tensors):
        return (dict(_load(tensors)),)


class _SavedExactly:
    """An output kept exactly (ComfyUI's own savers round it) as a safetensors file `name` in the output folder; a
    subclass names its input (`INPUT` of type `KIND`), the file's default name and the tensors it writes (`tensors`)."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    INPUT = KIND = DEFAULT = ""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {cls.INPUT: (cls.KIND,), "name": ("STRING", {"default": cls.DEFAULT})}}

    def save(self, name, **value):
        from safetensors.torch import save_file

        (value,) = value.values()
        save_file(self.tensors(value), os.path.join(folder_paths.get_output_directory(), name))
        return {}


class XDiTTestSaveAudio(_SavedExactly):
    """An AUDIO kept exactly (SaveAudio's FLAC rounds it to 16 bits): its waveform and sample rate."""

    INPUT, KIND, DEFAULT = "audio", "AUDIO", "audio.safetensors"

    @staticmethod
    def tensors(audio) -> dict:
        import torch

        return {"waveform": audio["waveform"].contiguous(), "sample_rate": torch.tensor(audio["sample_rate"])}


class XDiTTestSaveImage(_SavedExactly):
    """An IMAGE kept exactly (SaveImage rounds it to 8 bits): its frames [N, H, W, 3] as `images`."""

    INPUT, KIND, DEFAULT = "images", "IMAGE", "images.safetensors"

    @staticmethod
    def tensors(images) -> dict:
        return {"images": images.contiguous()}


TEXTS = "xdit-test-texts.json"  # in the input folder: {prompt text: the tensors file XDiTTestTextEncoder gives for it}
GENERATED = "xdit-test-generated"  # what the stand-in CLIP's TextGenerate writes, whatever it is asked


class _TextEncoder:
    """A loaded text encoder as CLIPTextEncode uses it: the tokens are the text; the CONDITIONING is the one a test
    saved for that text (named in TEXTS), in XDiTTestConditioning's layout."""

    def tokenize(self, text, **_):
        return text

    def encode_from_tokens_scheduled(self, text, **_):
        with open(os.path.join(folder_paths.get_input_directory(), TEXTS)) as file:
            return XDiTTestConditioning().load(json.load(file)[text])[0]

    def generate(self, text, **_):  # TextGenerate's LLM (Krea 2's prompt enhancer): one known text, GENERATED
        return GENERATED

    def decode(self, ids, **_):
        return ids


class XDiTTestTextEncoder:
    """CLIPLoader's and DualCLIPLoader's stand-in (a test drops their inputs: file names, type, device): a CLIP."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def load(self):
        return (_TextEncoder(),)


class _KeptDecode:
    """A VAE as VAEDecode uses it: the latent it is given is kept exactly (output/xdit-decoded/<n>.safetensors, in
    the order of the calls), and the image is black, 8× the latent per side (a video's 4n+1 frames). As
    WanImageToVideo uses it: encode gives a video's latent as the Wan 2.1 VAE shapes it (16 channels, 1/8 per side,
    4n+1 frames to n+1), a fixed function of the pixels, so ComfyUI's model and ours get the same one."""

    def encode(self, pixels):
        import torch

        video = pixels.movedim(-1, 0).unsqueeze(0)  # [T, H, W, 3] -> [1, 3, T, H, W]
        frames = torch.cat([torch.nn.functional.avg_pool3d(video[:, :, :1], (1, 8, 8)),
                            torch.nn.functional.avg_pool3d(video[:, :, 1:], (4, 8, 8))], dim=2)
        return torch.einsum("oc,bcthw->bothw", torch.linspace(-2, 2, 48).reshape(16, 3), frames)

    def decode(self, latent):
        import torch
        from safetensors.torch import save_file

        folder = os.path.join(folder_paths.get_output_directory(), "xdit-decoded")
        os.makedirs(folder, exist_ok=True)
        save_file({"latent": latent.contiguous()}, os.path.join(folder, f"{len(os.listdir(folder)):04d}.safetensors"))
        frames = ((latent.shape[2] - 1) * 4 + 1,) if latent.ndim == 5 else ()
        return torch.zeros(latent.shape[0], *frames, latent.shape[-2] * 8, latent.shape[-1] * 8, 3)


class XDiTTestVAE:
    """VAELoader's stand-in (a test drops its file name): a VAE that keeps what it decodes (_KeptDecode)."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def load(self):
        return (_KeptDecode(),)


class XDiTTestRecordCalls:
    """MODEL → MODEL that saves every diffusion-model call (x, timesteps, context, its tensor keywords: y, guidance,
    and the output) to output/<name>.safetensors as `i.x`, `i.t`, ...; re-run by every prompt, so each prompt's
    calls are its own."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "record"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "calls"})}}

    @classmethod
    def IS_CHANGED(cls, **inputs):
        return float("nan")

    def record(self, model, name):
        import comfy.patcher_extension
        import folder_paths
        import torch
        from safetensors.torch import save_file

        calls, path = {}, os.path.join(folder_paths.get_output_directory(), f"{name}.safetensors")

        def wrapper(executor, x, timesteps, context, *args, **kwargs):
            output = executor(x, timesteps, context, *args, **kwargs)
            i = len({key.split(".")[0] for key in calls})
            named = {"x": x, "t": timesteps, "context": context, "out": output, **kwargs}
            for key, value in named.items():
                if isinstance(value, torch.Tensor):
                    calls[f"{i}.{key}"] = value.detach().float().contiguous().clone()
            save_file(calls, path)
            return output

        recorded = model.clone()
        recorded.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, f"record-{name}", wrapper)
        return (recorded,)


class XDiTTestReferenceOrder:
    """An xDiT MODEL → one whose pool calls go without ComfyData.model_call_versions' inputs (PoolTransformer.versions
    emptied for each call, then restored), so the pool computes in the model's reference order whatever this ComfyUI's
    version: a test's control that those inputs are what makes the pool compute as this ComfyUI does."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "reference"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def reference(self, model):
        import comfy.patcher_extension

        def wrapper(executor, *args, **kwargs):
            pool = executor.class_obj
            versions, pool.versions = pool.versions, {}
            try:
                return executor(*args, **kwargs)
            finally:
                pool.versions = versions

        kept = model.clone()
        kept.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "reference-order", wrapper)
        return (kept,)


class XDiTTestDiffusersGate:
    """An xDiT MODEL → one whose LTX-2 pool calls go without `a2v_gate_reads_audio_timestep` (AudioCall.inputs wrapped
    for each call, then restored), so under a noise mask the pool gates each video token's audio-to-video update by its
    own timestep, as diffusers' transformer does: a test's control that the input is what makes ComfyUI's gate."""

    CATEGORY = "testing/xdit"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "diffusers_gate"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def diffusers_gate(self, model):
        import sys

        import comfy.patcher_extension

        def wrapper(executor, *args, **kwargs):
            call = sys.modules[type(executor.class_obj).__module__].AudioCall
            inputs = call.inputs
            call.inputs = lambda av: {k: v for k, v in inputs(av).items() if k != "a2v_gate_reads_audio_timestep"}
            try:
                return executor(*args, **kwargs)
            finally:
                call.inputs = inputs

        kept = model.clone()
        kept.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "diffusers-gate", wrapper)
        return (kept,)


NODE_CLASS_MAPPINGS = {"XDiTTestRecordCalls": XDiTTestRecordCalls, "XDiTTestReferenceOrder": XDiTTestReferenceOrder, "XDiTTestDiffusersGate": XDiTTestDiffusersGate, "XDiTTestConditioning": XDiTTestConditioning, "XDiTTestClipVision": XDiTTestClipVision,
                       "XDiTTestLatent": XDiTTestLatent, "XDiTTestSaveAudio": XDiTTestSaveAudio,
                       "XDiTTestSaveImage": XDiTTestSaveImage,
                       "XDiTTestTextEncoder": XDiTTestTextEncoder, "XDiTTestVAE": XDiTTestVAE}
