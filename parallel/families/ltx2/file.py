"""LTX-2.3's single files in Lightricks' layout, as ComfyUI's LTXAV model reads them: the transformer under
`model.diffusion_model.` (`patchify_proj`, `adaln_single`, `av_ca_*_adaln_single`, `transformer_blocks.N.attn1.q_norm`),
its text connectors beside it there (`video_embeddings_connector`, `audio_embeddings_connector`), and in the official
whole checkpoint the text projections (`text_embedding_projection.video_aggregate_embed`, `.audio_aggregate_embed`)
and the VAEs' latent statistics (`vae.` / `audio_vae.per_channel_statistics`) at the top level.

The transformer converts with diffusers' own converter (`convert_ltx2_transformer_to_diffusers`), after one rename it
does not make in 0.42.1 (LTX-2.3's prompt modulation, `prompt_adaln_single` → `prompt_adaln`). diffusers keeps the
connectors in a separate component (`LTX2TextConnectors`) and its converter drops them, so `components` reads them
here with the text projections into that component. The whole checkpoint's video VAE, audio VAE and vocoder load
beside them (file_vaes.py), so its pool decodes video and sound; where a file holds the VAEs' statistics alone (the
pipeline normalises given latents with them), they go into VAEs without weights, and decoding is ComfyUI's VAE Decode. ComfyUI's diffusion-model file (the transformer and connectors alone: ComfyUI's text
encoder holds the projections and has applied them to its text) loads without projections or VAEs: its pool takes
ComfyUI's model calls, which send projected text through the connectors, and refuses pipeline jobs in one line
(xFuserLTX2Pipeline.prepare). LTX-2.5 files (ComfyUI 0.33) differ in config flags diffusers' transformer has
(read_checkpoint). LTX-2.0 files (one shared text projection, a caption projection in the transformer) are
refused in one line.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from ..base import SingleFile, Variant
from . import file_vaes

log = logging.getLogger(__name__)

MARKER = "av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight"  # diffusers' CHECKPOINT_KEY_NAMES["ltx2"]
STACKED = 49  # Gemma 3 12B's embeddings and 48 layers' hidden states, stacked per token: every LTX-2.x's text encoder
PROJECTION = "text_embedding_projection.{}_aggregate_embed.weight"
CONNECTOR = "{}_embeddings_connector."
TOP = ("text_embedding_projection.", "vae.", "audio_vae.", "vocoder.")  # the whole checkpoint's other parts
SIDE = ("text_embedding_projection.", "vae.per_channel_statistics.", "audio_vae.per_channel_statistics.")


def read_checkpoint(shape) -> tuple[str, dict]:
    """LTX-2.3 or LTX-2.5 (ComfyUI 0.33, upstream 57ce8e1a) from the keys: 2.5's feed-forwards carry no biases and its
    learned keyframe marker (`keyframes_abs_pos_embedding`) sits beside `patchify_proj`; each difference is a config
    flag of diffusers' LTX2VideoTransformer3DModel, read from the keys (ComfyUI reads ff_bias from the file's
    metadata)."""
    if "transformer_blocks.0.prompt_scale_shift_table" not in shape or \
            "transformer_blocks.0.attn1.to_gate_logits.weight" not in shape:
        raise shape.error("an LTX-2.0 transformer (no prompt modulation or gated attention), whose single file this pack "
                          "does not load yet; use an LTX-2.3 or LTX-2.5 file, or LTX-2.0's diffusers folder")
    heads, width = shape("transformer_blocks.0.attn1.to_gate_logits.weight")
    audio_heads, audio_width = shape("transformer_blocks.0.audio_attn1.to_gate_logits.weight")
    flags = {"ff_bias": "transformer_blocks.0.ff.net.0.proj.bias" in shape,
             "audio_ff_bias": "transformer_blocks.0.audio_ff.net.0.proj.bias" in shape,
             "use_prompt_adaln_single": "prompt_adaln_single.linear.weight" in shape,
             "use_keyframes_abs_pos_embedding": "keyframes_abs_pos_embedding" in shape}
    later = flags["use_keyframes_abs_pos_embedding"] or not flags["ff_bias"]
    return "ltx-2.5" if later else "ltx-2.3", {
        "in_channels": shape("patchify_proj.weight")[1], "out_channels": shape("proj_out.weight")[0],
        "num_attention_heads": heads, "attention_head_dim": width // heads,
        "cross_attention_dim": shape("transformer_blocks.0.attn2.to_k.weight")[1],
        "audio_in_channels": shape("audio_patchify_proj.weight")[1], "audio_out_channels": shape("audio_proj_out.weight")[0],
        "audio_num_attention_heads": audio_heads, "audio_attention_head_dim": audio_width // audio_heads,
        "audio_cross_attention_dim": shape("transformer_blocks.0.audio_attn2.to_k.weight")[1],
        "num_layers": shape.blocks(r"transformer_blocks\.(\d+)\."), **flags,
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    for key in [k for k in state_dict if k.startswith(TOP)]:  # a GGUF keeps them unprefixed beside the transformer
        del state_dict[key]
    for key in [k for k in state_dict if k.startswith(("prompt_adaln_single.", "audio_prompt_adaln_single."))]:
        state_dict[key.replace("prompt_adaln_single.", "prompt_adaln.")] = state_dict.pop(key)
    return convert_ltx2_transformer_to_diffusers(state_dict)  # drops the connectors: `components` reads them


def _plain(tensors: dict, path, dtype: torch.dtype) -> dict:
    """Small side tensors as plain `dtype`: GGUF blocks and ComfyUI's scaled fp8 dequantized as their loaders do."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from ...loading.checkpoints import scaled

    tensors = {k: dequantize_gguf_tensor(v) if getattr(v, "quant_type", None) is not None else v
               for k, v in tensors.items()}
    weights, scales = scaled.read(tensors, path, dtype)
    if scales:
        weights = scaled.dequantize(weights, scales)
    return {k: v.to(dtype) for k, v in weights.items() if v.is_floating_point()}


def _projected(tensors: dict, path: Path) -> bool:
    """Whether the file holds both text projections (the whole checkpoint) or neither (ComfyUI's diffusion-model file)."""
    found = [PROJECTION.format(side) in tensors for side in ("video", "audio")]
    if any(found) != all(found):
        raise ValueError(f"{path} holds one of LTX-2.3's two text projections ({PROJECTION.format('video')} "
                         f"{'present' if found[0] else 'absent'}, the audio's {'present' if found[1] else 'absent'}): "
                         "the file is damaged; load the whole checkpoint as released")
    return all(found)


def _connectors(tensors: dict, path: Path, projected: bool):
    """diffusers' LTX2TextConnectors from the file's connectors and text projections, sizes from their shapes; without
    the projections (`projected` false) their modules are None, so nothing random stands in for them."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    sizes, stacked = {}, STACKED  # without projections: one feature per stacked state (a module that is then dropped)
    for side in ("video", "audio"):
        prefix = CONNECTOR.format(side)
        width = tensors[f"{prefix}transformer_1d_blocks.0.attn1.to_q.weight"].shape[0]
        if projected:
            stacked = tensors[PROJECTION.format(side)].shape[1]
        heads = tensors[f"{prefix}transformer_1d_blocks.0.attn1.to_gate_logits.weight"].shape[0]
        registers = tensors.get(f"{prefix}learnable_registers")
        layers = {int(m[1]) for k in tensors if (m := re.match(rf"{re.escape(prefix)}transformer_1d_blocks\.(\d+)\.", k))}
        sizes.update({f"{side}_connector_num_attention_heads": heads, f"{side}_connector_attention_head_dim": width // heads,
                      f"{side}_connector_num_layers": len(layers), f"{side}_hidden_dim": width, f"{side}_gated_attn": True,
                      f"{side}_connector_num_learnable_registers": None if registers is None else registers.shape[0]})
    if stacked % STACKED:
        raise ValueError(f"{path}: its text projection takes {stacked} features a token, not Gemma 3's {STACKED} stacked "
                         "hidden states of one width: the file is damaged or not LTX-2.3")
    connectors = LTX2TextConnectors(caption_channels=stacked // STACKED, text_proj_in_factor=STACKED, rope_type="split",
                                    per_modality_projections=True,
                                    proj_bias=PROJECTION.format("video").replace("weight", "bias") in tensors, **sizes)
    if not projected:
        connectors.video_text_proj_in = connectors.audio_text_proj_in = None
    renamed = {}
    for name, value in tensors.items():
        if name.startswith("text_embedding_projection."):
            renamed[name.replace("text_embedding_projection.", "").replace("_aggregate_embed", "_text_proj_in")] = value
        for side in ("video", "audio"):
            if name.startswith(CONNECTOR.format(side)):
                rest = name.removeprefix(CONNECTOR.format(side)).replace("transformer_1d_blocks", "transformer_blocks")
                renamed[f"{side}_connector.{rest.replace('q_norm', 'norm_q').replace('k_norm', 'norm_k')}"] = value
    connectors.load_state_dict(renamed, strict=True)
    return connectors.eval()


def _statistics(vae, tensors: dict, prefix: str, path: Path):
    """A VAE without weights but with the file's latent statistics, renamed by diffusers' own VAE converter."""
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers, convert_ltx2_vae_to_diffusers

    convert = convert_ltx2_audio_vae_to_diffusers if prefix == "audio_vae." else convert_ltx2_vae_to_diffusers
    names = [f"{prefix}per_channel_statistics.{s}" for s in ("mean-of-means", "std-of-means")]
    if absent := [n for n in names if n not in tensors]:
        raise ValueError(f"{path} has no {absent[0]}, the latent statistics LTX2Pipeline normalises latents with: load "
                         "LTX-2.3's whole checkpoint, which holds its VAEs")
    converted = convert({n.removeprefix(prefix): tensors[n] for n in names})
    with torch.no_grad():
        for name in ("latents_mean", "latents_std"):
            getattr(vae, name).copy_(converted[name])
    return vae


def components(path: Path, config_dir: Path, dtype: torch.dtype) -> dict:
    """The pipeline's parts the file holds beside the transformer: text connectors (and projections) and, in the whole
    checkpoint, the VAEs and the vocoder (or, where it holds them alone, the VAEs' statistics)."""
    import diffusers
    from accelerate import init_empty_weights

    from ...loading.checkpoints import CheckpointFile

    checkpoint = CheckpointFile(path)
    names = _names(checkpoint)
    whole = tuple(name.split(".")[0] + "." for name in file_vaes.WEIGHTS.values() if name in names)
    side = [k for k in names if k.startswith((*SIDE, *whole, *(checkpoint.prefix + CONNECTOR.format(s)
                                                                   for s in ("video", "audio"))))]
    if any(k.endswith(".scale_weight") for k in side):  # ComfyUI's scaled fp8 side layers: read with their marker
        side.append(checkpoint.prefix + "scaled_fp8")
    tensors = _plain(_read(checkpoint, side), path, dtype)
    projected = _projected(tensors, path)
    if projected and checkpoint.prefix + "keyframes_abs_pos_embedding" in names:
        raise ValueError(f"{path} is LTX-2.5's whole checkpoint, whose VAEs this pack does not read yet: load its "
                         "diffusion-model file (the transformer and connectors) with Load Diffusion Model (xDiT Pool)")
    out = {"connectors": _connectors(tensors, path, projected).to(dtype)}
    if not projected:  # ComfyUI's diffusion-model file: model calls only, so no VAE statistics either
        return {**out, "vae": None, "audio_vae": None}
    index = json.loads((config_dir / "model_index.json").read_text())
    unread = {}
    for name, load in (("vae", file_vaes.video_vae), ("audio_vae", file_vaes.audio_vae), ("vocoder", file_vaes.vocoder)):
        if file_vaes.WEIGHTS[name] in names:
            try:
                out[name] = load(tensors, config_dir, path).to(dtype)
            except file_vaes.LayoutError as error:  # sampling needs only the statistics: decoding says why it cannot
                log.warning("%s; the pool samples, and decodes with ComfyUI's VAE Decode", error)
                unread[name] = str(error)
    for name, prefix in (("vae", "vae."), ("audio_vae", "audio_vae.")):
        if name in out:
            continue
        cls = getattr(diffusers, index[name][1])
        with init_empty_weights():  # weights on meta, buffers (the statistics) real
            vae = cls.from_config(cls.load_config(config_dir, subfolder=name))
        for module in vae.modules():  # none left on meta: the pipeline takes its device from its first module's
            module._parameters.clear()
        vae.statistics_only = unread.get(name, True)  # decode jobs are refused on it (workers/rank/validation.py)
        out[name] = _statistics(vae, tensors, prefix, path)
    return out


def _names(checkpoint) -> list[str]:
    """Every tensor name in the file, the top-level ones too (the transformer's reader strips its prefix)."""
    if checkpoint.is_gguf:
        import gguf

        return [t.name for t in gguf.GGUFReader(checkpoint.path).tensors]
    from safetensors import safe_open

    with safe_open(checkpoint.path, framework="pt") as handle:
        return list(handle.keys())


def _read(checkpoint, names: list[str]) -> dict:
    """`names` from the file, the transformer's prefix (if any) dropped (GGUF tensors as diffusers reads them)."""
    if checkpoint.is_gguf:
        from diffusers.models.model_loading_utils import load_gguf_checkpoint

        tensors = load_gguf_checkpoint(str(checkpoint.path), return_tensors=True)
    else:
        from safetensors import safe_open

        with safe_open(checkpoint.path, framework="pt") as handle:
            tensors = {n: handle.get_tensor(n) for n in names}
    return {n.removeprefix(checkpoint.prefix): tensors[n] for n in names}


SINGLE_FILE = SingleFile(
    marker=MARKER, title="LTX-2.3",
    variants={"ltx-2.3": Variant("ltx2", "LTX-2.3 text to video with sound",
                                 "Lightricks keys av_ca_a2v_gate_adaln_single, prompt_adaln_single (the whole checkpoint, or "
                                 "ComfyUI's diffusion-model file: model calls only)"),
              "ltx-2.5": Variant("ltx2", "LTX-2.5 text to video with sound",
                                 "LTX-2.3's keys with keyframes_abs_pos_embedding or feed-forwards without biases "
                                 "(ComfyUI's diffusion-model file: model calls only)")},
    read=read_checkpoint, convert=convert_checkpoint, components=components)
