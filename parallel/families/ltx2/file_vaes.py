"""The decoders of LTX-2.3's whole checkpoint, as diffusers' own converters read them: the video VAE under `vae.`
(`convert_ltx2_vae_to_diffusers`; its fourth decoder stage, which that converter leaves unnamed, named as diffusers'
LTX-2.3 conversion names it), the audio VAE under `audio_vae.` (`convert_ltx2_audio_vae_to_diffusers`), and the
vocoder with its bandwidth extension under `vocoder.` (`vocoder.` and `bwe_generator.`, ComfyUI's VocoderWithBWE),
which diffusers 0.42.1's single-file loader has no converter for: its names follow diffusers' LTX-2.3 conversion
(`ups` → `upsamplers`, `resblocks` → `resnets`, `conv_pre`/`conv_post` → `conv_in`/`conv_out`, `act_post` → `act_out`,
`downsample.lowpass` → `downsample`), and tests/test_ltx2_files.py checks them against ComfyUI's own models.

Each loads into the shipped config with the widths, depths and upsampling kinds its shapes say, so a tiny or pruned
file loads too; a part in another layout (LayoutError, one line) stays out: the pool samples, and its decode is refused
with that line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

WEIGHTS = {"vae": "vae.decoder.conv_in.conv.weight", "audio_vae": "audio_vae.decoder.conv_in.conv.weight",
           "vocoder": "vocoder.bwe_generator.conv_pre.weight"}  # a part is in the file when its key is
VOCODER_NAMES = {"resblocks": "resnets", "conv_pre": "conv_in", "conv_post": "conv_out", "act_post": "act_out",
                 "downsample.lowpass": "downsample", ".ups.": ".upsamplers."}


class LayoutError(ValueError):
    """A part in a layout diffusers' converter does not read: the pool still samples, and its decode says this."""


def _refuse(path: Path, part: str, error: Exception | str) -> LayoutError:
    detail = " ".join(str(error).split())[:300]
    return LayoutError(f"{path.name}'s {part} is not in the layout diffusers' converter reads: {detail}")


def _load(model, weights: dict, path: Path, part: str):
    """`weights` into `model`, every name and shape matching, or LayoutError naming the first that do not."""
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # shapes
        raise _refuse(path, part, error) from None
    if result.missing_keys or result.unexpected_keys:
        raise _refuse(path, part, f"{len(result.unexpected_keys)} names it does not know ({result.unexpected_keys[:2]}), "
                                  f"{len(result.missing_keys)} missing ({result.missing_keys[:2]})")
    return model.eval()


def _count(weights: dict, pattern: str) -> int:
    return len({m[1] for k in weights if (m := re.match(pattern, k))})


def video_vae(tensors: dict, config_dir: Path, path: Path):
    """diffusers' AutoencoderKLLTX2Video from the file's `vae.` weights by diffusers' own converter: the shipped config
    with the channels and depths the shapes say (a tiny or pruned VAE too). LTX-2.3's decoder has a fourth stage
    (`up_blocks.7`, `.8`) that diffusers 0.42.1's converter leaves unnamed: it becomes `up_blocks.3` as diffusers'
    LTX-2.3 conversion names it, and each stage's upsampling (time, space or both; the channels it folds) is read
    from its convolution's shape. What no shape holds (residual upsampling, the padding) comes from the file's own
    config (`config` → `vae` in its metadata, as ComfyUI reads it), else from the shipped one."""
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

    weights = convert_ltx2_vae_to_diffusers({k: v for k, v in tensors.items() if k.startswith("vae.")})
    for name in [k for k in weights if k.startswith(("decoder.up_blocks.7.", "decoder.up_blocks.8."))]:
        stage = "3.upsamplers.0." if name.startswith("decoder.up_blocks.7.") else "3."
        weights["decoder.up_blocks." + stage + name.split(".", 3)[3]] = weights.pop(name)
    config = dict(AutoencoderKLLTX2Video.load_config(config_dir, subfolder="vae"))

    def layers(prefix: str) -> int:
        return _count(weights, rf"{re.escape(prefix)}resnets\.(\d+)\.")

    try:
        stages = _count(weights, r"decoder\.up_blocks\.(\d+)\.upsamplers\.")
        config.update(
            latent_channels=weights["decoder.conv_in.conv.weight"].shape[1],
            block_out_channels=[weights[f"encoder.down_blocks.{i}.downsamplers.0.conv.conv.weight"].shape[1]
                                for i in (1, 2, 3)] + [weights["encoder.conv_out.conv.weight"].shape[1]],
            layers_per_block=[layers(f"encoder.down_blocks.{i}.") for i in range(4)] + [layers("encoder.mid_block.")],
            decoder_layers_per_block=[layers(f"decoder.up_blocks.{i}.") for i in reversed(range(stages))]
            + [layers("decoder.mid_block.")],
            **_upsampling(weights, stages, config, _file_config(path), path))
        vae = AutoencoderKLLTX2Video.from_config(config)
    except KeyError as error:
        raise _refuse(path, "video VAE (vae.*)", f"no {error}") from None
    return _load(vae, weights, path, "video VAE (vae.*)")


STRIDES = {8: "spatiotemporal", 2: "temporal", 4: "spatial"}  # the upsampling kinds by the voxels one becomes


def _upsampling(weights: dict, stages: int, shipped: dict, own: dict | None, path: Path) -> dict:
    """The decoder's stages, as diffusers' config lists them (its channels and factors in reverse, its kinds not):
    each stage's convolution takes `width` channels and makes width × voxels ÷ factor, the next stage's width × voxels."""
    widths = [weights[f"decoder.up_blocks.{i}.upsamplers.0.conv.conv.weight"].shape[1] for i in range(stages)]
    widths.append(weights["decoder.conv_out.conv.weight"].shape[1])
    factors = [widths[i] // widths[i + 1] for i in range(stages)]
    voxels = [weights[f"decoder.up_blocks.{i}.upsamplers.0.conv.conv.weight"].shape[0] // widths[i + 1]
              for i in range(stages)]
    if any(v not in STRIDES for v in voxels):
        raise _refuse(path, "video VAE (vae.*)", f"its decoder's stages make {voxels} voxels of one, not 2, 4 or 8")
    if own is not None:  # ComfyUI's decoder_blocks, in the encoder's order: the decoder runs them reversed
        blocks = [params for name, params in reversed(own.get("decoder_blocks", own.get("blocks", [])))
                  if name.startswith("compress")]
        residual = [isinstance(p, dict) and bool(p.get("residual", False)) for p in blocks]
        padding, causal = own.get("spatial_padding_mode", "reflect"), own.get("causal_decoder", False)
        timestep = own.get("timestep_conditioning", False)
    elif len(shipped["upsample_residual"]) == stages:
        residual = list(reversed(shipped["upsample_residual"]))
        padding, causal = shipped["decoder_spatial_padding_mode"], shipped["decoder_causal"]
        timestep = shipped["timestep_conditioning"]
    else:
        raise _refuse(path, "video VAE (vae.*)", f"its decoder has {stages} stages and the file no config (metadata "
                                                 "`config` → `vae`) saying how they upsample")
    if len(residual) != stages:
        raise _refuse(path, "video VAE (vae.*)", f"its config lists {len(residual)} decoder stages, its weights {stages}")
    return {"decoder_block_out_channels": widths[stages - 1::-1], "upsample_factor": factors[::-1],
            "upsample_type": [STRIDES[v] for v in voxels], "upsample_residual": residual[::-1],
            "decoder_spatio_temporal_scaling": [True] * stages, "decoder_inject_noise": [False] * (stages + 1),
            "decoder_spatial_padding_mode": padding, "decoder_causal": causal, "timestep_conditioning": timestep}


def _file_config(path: Path) -> dict | None:
    """The VAE's config in a safetensors file's metadata (Lightricks' checkpoints carry one), or None."""
    if Path(path).suffix != ".safetensors":
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    try:
        return json.loads(metadata["config"]).get("vae")
    except (KeyError, ValueError, AttributeError):
        return None


def audio_vae(tensors: dict, config_dir: Path, path: Path):
    """diffusers' AutoencoderKLLTX2Audio from the file's `audio_vae.` weights by diffusers' own converter, its widths and
    depths from the shapes (its latent statistics are `base_channels` wide: 128, latent channels × mel bins)."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers

    weights = convert_ltx2_audio_vae_to_diffusers({k: v for k, v in tensors.items() if k.startswith("audio_vae.")})
    config = dict(AutoencoderKLLTX2Audio.load_config(config_dir, subfolder="audio_vae"))
    try:
        base = weights["encoder.conv_in.conv.weight"].shape[0]
        levels = _count(weights, r"encoder\.down\.(\d+)\.")
        config.update(
            base_channels=base, in_channels=weights["encoder.conv_in.conv.weight"].shape[1],
            output_channels=weights["decoder.conv_out.conv.weight"].shape[0],
            latent_channels=weights["decoder.conv_in.conv.weight"].shape[1],
            ch_mult=[weights[f"encoder.down.{i}.block.0.conv2.conv.weight"].shape[0] // base for i in range(levels)],
            num_res_blocks=_count(weights, r"encoder\.down\.0\.block\.(\d+)\."))
        vae = AutoencoderKLLTX2Audio.from_config(config)
    except KeyError as error:
        raise _refuse(path, "audio VAE (audio_vae.*)", f"no {error}") from None
    return _load(vae, weights, path, "audio VAE (audio_vae.*)")


def vocoder(tensors: dict, config_dir: Path, path: Path):
    """diffusers' LTX2VocoderWithBWE from the file's `vocoder.` weights renamed as diffusers' LTX-2.3 conversion names
    them; the widths, kernels and stages from the shapes, the strides and rates (which no shape holds) from the shipped
    config."""
    from diffusers.pipelines.ltx2 import LTX2VocoderWithBWE

    weights = {}
    for name, value in tensors.items():
        if name.startswith("vocoder."):
            name = name.removeprefix("vocoder.")
            for old, new in VOCODER_NAMES.items():
                name = name.replace(old, new)
            weights[name] = value
    config = dict(LTX2VocoderWithBWE.load_config(config_dir, subfolder="vocoder"))
    try:
        for stage, key in (("vocoder.", ""), ("bwe_generator.", "bwe_")):
            ups = _count(weights, rf"{stage}upsamplers\.(\d+)\.")
            kernels = _count(weights, rf"{stage}resnets\.(\d+)\.") // max(ups, 1)
            if ups != len(config[f"{key}upsample_factors"]) or kernels > len(config[f"{key}resnet_dilations"]):
                raise _refuse(path, "vocoder (vocoder.*)", f"{stage} has {ups} upsampling stages of {kernels} kernels, "
                              f"LTX-2.3's {len(config[key + 'upsample_factors'])} of at most "
                              f"{len(config[key + 'resnet_dilations'])}")
            config.update({f"{key}in_channels": weights[f"{stage}conv_in.weight"].shape[1],
                           f"{key}hidden_channels": weights[f"{stage}conv_in.weight"].shape[0],
                           f"{key}out_channels": weights[f"{stage}conv_out.weight"].shape[0],
                           f"{key}upsample_kernel_sizes": [weights[f"{stage}upsamplers.{i}.weight"].shape[2]
                                                           for i in range(ups)],
                           f"{key}resnet_kernel_sizes": [weights[f"{stage}resnets.{j}.convs1.0.weight"].shape[2]
                                                         for j in range(kernels)],
                           f"{key}resnet_dilations": config[f"{key}resnet_dilations"][:kernels],
                           f"{key}final_bias": f"{stage}conv_out.bias" in weights})
        window = weights["mel_stft.stft_fn.forward_basis"].shape[2]
        config.update(num_mel_channels=weights["mel_stft.mel_basis"].shape[0], filter_length=window, window_length=window)
        model = LTX2VocoderWithBWE.from_config(config)
    except KeyError as error:
        raise _refuse(path, "vocoder (vocoder.*)", f"no {error}") from None
    return _load(model, weights, path, "vocoder (vocoder.*)")
