"""diffusers transformers written back in their original single-file layouts (BFL, SAI, PixArt, Wan,
Comfy-Org's), the inverse of diffusers' converters: how the tests make the files users download."""

from __future__ import annotations

import re

import torch

PIXART_TOKENS = {"pixart-alpha": 120, "pixart-sigma": 300}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """diffusers' swap_scale_shift is its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class _Inverse:
    """Builds an original-layout dict from a diffusers state dict, checking every diffusers key is used."""

    def __init__(self, state_dict: dict):
        self.src, self.out = dict(state_dict), {}

    def move(self, src: str, dst: str, kinds=("weight", "bias"), fn=lambda t: t):
        for kind in kinds:
            self.out[f"{dst}.{kind}" if kind else dst] = fn(self.src.pop(f"{src}.{kind}" if kind else src)).clone()

    def fuse(self, srcs, dst: str):
        for kind in ("weight", "bias"):
            self.out[f"{dst}.{kind}"] = torch.cat([self.src.pop(f"{s}.{kind}") for s in srcs], dim=0)

    def done(self) -> dict:
        assert not self.src, f"diffusers keys with no original counterpart: {sorted(self.src)}"
        return self.out


def flux_to_bfl(sd: dict, config) -> dict:
    inv = _Inverse(sd)
    for src, dst in (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"),
                     ("guidance_embedder", "guidance_in")):
        if f"time_text_embed.{src}.linear_1.weight" in inv.src:
            inv.move(f"time_text_embed.{src}.linear_1", f"{dst}.in_layer")
            inv.move(f"time_text_embed.{src}.linear_2", f"{dst}.out_layer")
    inv.move("context_embedder", "txt_in")
    inv.move("x_embedder", "img_in")
    for i in range(config.num_layers):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        inv.move(d + "norm1.linear", b + "img_mod.lin")
        inv.move(d + "norm1_context.linear", b + "txt_mod.lin")
        inv.fuse([d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], b + "img_attn.qkv")
        inv.fuse([d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], b + "txt_attn.qkv")
        for src, dst in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            inv.out[b + dst + ".scale"] = inv.src.pop(d + f"attn.{src}.weight")
        inv.move(d + "ff.net.0.proj", b + "img_mlp.0")
        inv.move(d + "ff.net.2", b + "img_mlp.2")
        inv.move(d + "ff_context.net.0.proj", b + "txt_mlp.0")
        inv.move(d + "ff_context.net.2", b + "txt_mlp.2")
        inv.move(d + "attn.to_out.0", b + "img_attn.proj")
        inv.move(d + "attn.to_add_out", b + "txt_attn.proj")
    for i in range(config.num_single_layers):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        inv.move(d + "norm.linear", b + "modulation.lin")
        inv.fuse([d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"], b + "linear1")
        inv.out[b + "norm.query_norm.scale"] = inv.src.pop(d + "attn.norm_q.weight")
        inv.out[b + "norm.key_norm.scale"] = inv.src.pop(d + "attn.norm_k.weight")
        inv.move(d + "proj_out", b + "linear2")
    inv.move("proj_out", "final_layer.linear")
    inv.move("norm_out.linear", "final_layer.adaLN_modulation.1", fn=_swap_halves)
    return inv.done()


def flux2_to_bfl(sd: dict, config) -> dict:
    """FLUX.2 in BFL's layout (flux2's model.py): shared modulations, fused qkv, fused qkv+MLP single blocks;
    checked to convert back to exactly these tensors with diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    inv = _Inverse(sd)
    kinds = lambda name: tuple(k for k in ("weight", "bias") if f"{name}.{k}" in inv.src)  # noqa: E731
    for src, dst in (("x_embedder", "img_in"), ("context_embedder", "txt_in"), ("proj_out", "final_layer.linear"),
                     ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                     ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                     ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),  # [dev]
                     ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
                     ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
                     ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
                     ("single_stream_modulation.linear", "single_stream_modulation.lin")):
        if kinds(src):
            inv.move(src, dst, kinds=kinds(src))
    inv.move("norm_out.linear", "final_layer.adaLN_modulation.1", kinds=kinds("norm_out.linear"), fn=_swap_halves)
    for i in range(config.num_layers):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for names, dst in ((("to_q", "to_k", "to_v"), "img_attn.qkv"), (("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv")):
            for kind in kinds(d + "attn." + names[0]):
                inv.out[f"{b}{dst}.{kind}"] = torch.cat([inv.src.pop(f"{d}attn.{n}.{kind}") for n in names])
        for src, dst in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            inv.out[b + dst + ".scale"] = inv.src.pop(d + f"attn.{src}.weight")
        for src, dst in (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"), ("ff.linear_in", "img_mlp.0"),
                         ("ff.linear_out", "img_mlp.2"), ("ff_context.linear_in", "txt_mlp.0"),
                         ("ff_context.linear_out", "txt_mlp.2")):
            inv.move(d + src, b + dst, kinds=kinds(d + src))
    for i in range(config.num_single_layers):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        inv.out[b + "norm.query_norm.scale"] = inv.src.pop(d + "attn.norm_q.weight")
        inv.out[b + "norm.key_norm.scale"] = inv.src.pop(d + "attn.norm_k.weight")
        inv.move(d + "attn.to_qkv_mlp_proj", b + "linear1", kinds=kinds(d + "attn.to_qkv_mlp_proj"))
        inv.move(d + "attn.to_out", b + "linear2", kinds=kinds(d + "attn.to_out"))
    out = inv.done()
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(out))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd), "FLUX.2 names do not round-trip"
    return out


def _ldm_vae_name(key: str, levels: int) -> str:
    """One diffusers AutoencoderKL-style name in the original (ldm) VAE layout, as BFL's autoencoders keep it."""
    part, rest = key.split(".", 1)
    resnet = lambda name: name.replace("conv_shortcut", "nin_shortcut")  # noqa: E731
    attention = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    if m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
        return f"{part}.down.{m[1]}.block.{m[2]}.{resnet(m[3])}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.(.*)", rest):
        return f"{part}.down.{m[1]}.downsample.{m[2]}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):  # the decoder's levels reversed
        return f"{part}.up.{levels - 1 - int(m[1])}.block.{m[2]}.{resnet(m[3])}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
        return f"{part}.up.{levels - 1 - int(m[1])}.upsample.{m[2]}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.*)", rest):
        return f"{part}.mid.block_{int(m[1]) + 1}.{resnet(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.*)\.(weight|bias)", rest):
        return f"{part}.mid.attn_1.{attention[m[1]]}.{m[2]}"
    return f"{part}.{rest.replace('conv_norm_out', 'norm_out')}"


def flux2_vae_to_original(vae) -> dict:
    """An AutoencoderKLFlux2's weights as BFL's FLUX.2 VAE file holds them (ldm names, quant convs inside the
    encoder and decoder, 1×1 conv attention, the batch-norm statistics); checked to convert back exactly with
    the pack's converter."""
    from parallel.families.flux2 import convert_vae

    sd = {k: v for k, v in vae.state_dict().items() if k != "bn.num_batches_tracked"}  # torch's BatchNorm adds it
    levels = len(vae.config.block_out_channels)
    out = {}
    for key, value in sd.items():
        if key.startswith(("quant_conv.", "post_quant_conv.")):
            out[("encoder." if key.startswith("quant") else "decoder.") + key] = value
        elif key.startswith("bn."):
            out[key] = value
        else:
            name = _ldm_vae_name(key, levels)
            out[name] = value[:, :, None, None] if ".mid.attn_1." in name and value.ndim == 2 else value
    back = convert_vae(dict(out), vae.config)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd), "FLUX.2 VAE names do not round-trip"
    return {k: v.contiguous() for k, v in out.items()}


def sd3_to_sai(sd: dict, config) -> dict:
    inv = _Inverse(sd)
    inv.out["pos_embed"] = inv.src.pop("pos_embed.pos_embed").clone()
    inv.move("pos_embed.proj", "x_embedder.proj")
    inv.move("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0")
    inv.move("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2")
    inv.move("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0")
    inv.move("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2")
    inv.move("context_embedder", "context_embedder")
    last = config.num_layers - 1
    for i in range(config.num_layers):
        d, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        inv.fuse([d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], x + "attn.qkv")
        inv.fuse([d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], c + "attn.qkv")
        if config.qk_norm:
            inv.move(d + "attn.norm_q", x + "attn.ln_q", kinds=("weight",))
            inv.move(d + "attn.norm_k", x + "attn.ln_k", kinds=("weight",))
            inv.move(d + "attn.norm_added_q", c + "attn.ln_q", kinds=("weight",))
            inv.move(d + "attn.norm_added_k", c + "attn.ln_k", kinds=("weight",))
        inv.move(d + "attn.to_out.0", x + "attn.proj")
        if i in config.dual_attention_layers:
            inv.fuse([d + "attn2.to_q", d + "attn2.to_k", d + "attn2.to_v"], x + "attn2.qkv")
            if config.qk_norm:
                inv.move(d + "attn2.norm_q", x + "attn2.ln_q", kinds=("weight",))
                inv.move(d + "attn2.norm_k", x + "attn2.ln_k", kinds=("weight",))
            inv.move(d + "attn2.to_out.0", x + "attn2.proj")
        inv.move(d + "norm1.linear", x + "adaLN_modulation.1")
        inv.move(d + "ff.net.0.proj", x + "mlp.fc1")
        inv.move(d + "ff.net.2", x + "mlp.fc2")
        if i == last:  # the last context block only modulates (shift/scale order differs from diffusers)
            inv.move(d + "norm1_context.linear", c + "adaLN_modulation.1", fn=_swap_halves)
        else:
            inv.move(d + "norm1_context.linear", c + "adaLN_modulation.1")
            inv.move(d + "attn.to_add_out", c + "attn.proj")
            inv.move(d + "ff_context.net.0.proj", c + "mlp.fc1")
            inv.move(d + "ff_context.net.2", c + "mlp.fc2")
    inv.move("proj_out", "final_layer.linear")
    inv.move("norm_out.linear", "final_layer.adaLN_modulation.1", fn=_swap_halves)
    return inv.done()


def pixart_to_original(sd: dict, config, tokens: int, pos_embed: torch.Tensor) -> dict:
    inv = _Inverse(sd)
    inv.move("pos_embed.proj", "x_embedder.proj")
    inv.move("caption_projection.linear_1", "y_embedder.y_proj.fc1")
    inv.move("caption_projection.linear_2", "y_embedder.y_proj.fc2")
    emb = "adaln_single.emb."
    inv.move(emb + "timestep_embedder.linear_1", "t_embedder.mlp.0")
    inv.move(emb + "timestep_embedder.linear_2", "t_embedder.mlp.2")
    if config.use_additional_conditions:
        for dst, src in (("csize_embedder", "resolution_embedder"), ("ar_embedder", "aspect_ratio_embedder")):
            inv.move(f"{emb}{src}.linear_1", f"{dst}.mlp.0")
            inv.move(f"{emb}{src}.linear_2", f"{dst}.mlp.2")
    inv.move("adaln_single.linear", "t_block.1")
    for i in range(config.num_layers):
        d, b = f"transformer_blocks.{i}.", f"blocks.{i}."
        inv.move(d + "scale_shift_table", b + "scale_shift_table", kinds=(None,))
        inv.fuse([d + "attn1.to_q", d + "attn1.to_k", d + "attn1.to_v"], b + "attn.qkv")
        inv.move(d + "attn1.to_out.0", b + "attn.proj")
        inv.move(d + "attn2.to_q", b + "cross_attn.q_linear")
        inv.fuse([d + "attn2.to_k", d + "attn2.to_v"], b + "cross_attn.kv_linear")
        inv.move(d + "attn2.to_out.0", b + "cross_attn.proj")
        inv.move(d + "ff.net.0.proj", b + "mlp.fc1")
        inv.move(d + "ff.net.2", b + "mlp.fc2")
    inv.move("proj_out", "final_layer.linear")
    inv.move("scale_shift_table", "final_layer.scale_shift_table", kinds=(None,))
    out = inv.done()
    # Saved by the PixArt repository next to the weights; diffusers recomputes / does not use them.
    out["y_embedder.y_embedding"] = torch.zeros(tokens, config.caption_channels)
    out["pos_embed"] = pos_embed.clone()
    return out


_WAN_NAMES = [  # diffusers -> Wan's original names (the inverse of diffusers' rename table), in order
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),  # Wan 2.1 I2V's CLIP vision projection
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"), ("attn1", "self_attn"), (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."),
    (".to_v.", ".v."), ("proj_out", "head.head"), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__placeholder"), ("norm3", "norm2"), ("norm__placeholder", "norm3"),
]


def wan_to_original(sd: dict) -> dict:
    out = {}
    for key, value in sd.items():
        for ours, theirs in _WAN_NAMES:
            key = key.replace(ours, theirs)
        key = "head.modulation" if key == "scale_shift_table" else key.replace(".scale_shift_table", ".modulation")
        out[key] = value
    return out


_WAN_VAE_RESIDUAL = (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."),
                     ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))


def _wan_vae_residual(name: str) -> str:
    return next((theirs + name[len(ours):] for ours, theirs in _WAN_VAE_RESIDUAL if name.startswith(ours)), name)


def _wan_vae_name(key: str) -> str:
    """One AutoencoderKLWan name in Wan's own VAE layout (wan/modules/vae.py: flat `downsamples`/`upsamples`
    lists of residual blocks and resamples, `middle` = [residual, attention, residual], `head` = [norm, SiLU, conv])."""
    for ours, theirs in (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")):
        if key.startswith(ours):
            return theirs + key[len(ours):]
    part, rest = key.split(".", 1)
    for ours, theirs in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(ours):
            return f"{part}.{theirs}{rest[len(ours):]}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.*)", rest):
        return f"{part}.middle.{2 * int(m[1])}.{_wan_vae_residual(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.*)", rest):
        return f"{part}.middle.1.{m[1]}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(.*)", rest):
        return f"{part}.downsamples.{m[1]}.{_wan_vae_residual(m[2])}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):  # 3 residual blocks + 1 resample a level
        return f"{part}.upsamples.{4 * int(m[1]) + int(m[2])}.{_wan_vae_residual(m[3])}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
        return f"{part}.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
    raise KeyError(f"no Wan VAE name for {key}")


def wan_vae_to_original(vae) -> dict:
    """A Wan 2.1-structured AutoencoderKLWan's weights as wan_2.1_vae.safetensors holds them; checked to convert
    back to exactly these names with diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    sd = vae.state_dict()
    out = {_wan_vae_name(k): v.contiguous() for k, v in sd.items()}
    assert convert_wan_vae_to_diffusers(dict(out)).keys() == sd.keys(), "the inverse Wan VAE names do not round-trip"
    return out


def z_image_to_original(sd: dict) -> dict:
    """Tongyi-MAI's layout under ComfyUI's prefix: q, k, v fused, the embedder and final layer of patch 2-1 without
    diffusers' per-patch dicts (the inverse of diffusers' convert_z_image_transformer_checkpoint_to_diffusers)."""
    renames = {"all_x_embedder.2-1.": "x_embedder.", "all_final_layer.2-1.": "final_layer.", ".attention.norm_q.": ".attention.q_norm.",
               ".attention.norm_k.": ".attention.k_norm.", ".attention.to_out.0.": ".attention.out."}
    out = {}
    for key, value in sd.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [sd[key.replace("to_q", name)] for name in ("to_q", "to_k", "to_v")]
            key, value = key.replace(".attention.to_q.", ".attention.qkv."), torch.cat(parts, dim=0)
        for old, new in renames.items():
            key = key.replace(old, new)
        out[f"model.diffusion_model.{key}"] = value.clone()
    return out


KREA2_NAMES = (  # diffusers' name → Krea's, the inverse of convert_krea2_transformer_checkpoint_to_diffusers
    ("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
    ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"))
KREA2_BLOCK_NAMES = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
                     (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
                     (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
                     (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
                     (".scale_shift_table", ".mod.lin"))


def krea2_to_original(sd: dict) -> dict:
    """Krea's layout, as Comfy-Org's repackaged files keep it: each block's six modulation vectors flattened."""
    out = {}
    for key, value in sd.items():
        name = next((new + key[len(old):] for old, new in KREA2_NAMES if key.startswith(old)), key)
        for old, new in KREA2_BLOCK_NAMES:
            name = name.replace(old, new)
        out[name] = (value.flatten() if name.startswith("blocks.") and name.endswith(".mod.lin") else value).clone()
    return out


def flux3_to_bfl(sd: dict) -> dict:
    """FLUX 3 in BFL's layout: diffusers' convert_flux3_transformer_checkpoint_to_diffusers undone (its renames
    inverted, the output norm's [scale, shift] halves swapped back), checked to convert back exactly."""
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers, swap_scale_shift

    exact = {"timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
             "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
             "target_timestep_embedder.linear_1.weight": "ref_time_in.in_layer.weight",
             "target_timestep_embedder.linear_2.weight": "ref_time_in.out_layer.weight",
             "proj_out.weight": "final_layer.image.linear.weight",
             "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight"}
    prefixes = {"x_embedders.": "emb_in.", "context_embedder.": "txt_in.", "mode_blocks.": "content_mode_blocks.",
                "single_transformer_blocks.": "single_blocks."}
    suffixes = {"attn.to_q.weight": "q_proj.weight", "attn.to_k.weight": "k_proj.weight", "attn.to_v.weight": "v_proj.weight",
                "attn.to_out.0.weight": "attn_out.weight", "attn.norm_q.weight": "norm.query_norm.scale",
                "attn.norm_k.weight": "norm.key_norm.scale", "ff.linear_in.weight": "mlp_in.weight",
                "ff.linear_out.weight": "mlp_out.weight"}
    out = {}
    for key, value in sd.items():
        if key in exact:
            out[exact[key]] = swap_scale_shift(value, dim=0) if key == "norm_out.linear.weight" else value
            continue
        new = next((to + key[len(old):] for old, to in prefixes.items() if key.startswith(old)), key)
        new = new.replace(".linear.weight", ".lin.weight")
        new = next((new[: -len(old)] + to for old, to in suffixes.items() if new.endswith(old)), new)
        out[new] = value
    back = convert_flux3_transformer_checkpoint_to_diffusers(dict(out))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    return out


def hunyuan_video15_to_original(sd: dict) -> dict:
    """Tencent's HunyuanVideo 1.5 layout with q, k, v fused, as ComfyUI loads it: the inverse of the pack's converter
    (parallel/families/hunyuanvideo15_file.py), checked to convert back to exactly these tensors."""
    from parallel.families.hunyuanvideo15_file import _DOUBLE, _FUSED, _NAMES, _REFINER, convert_checkpoint

    def inverse(table, fused=()):
        names = {target: pattern.replace("\\", "") for pattern, target in table}
        return names, {_FUSED[name]: name for name in fused}

    scopes = [("context_embedder.token_refiner.refiner_blocks.", "txt_in.individual_token_refiner.blocks.",
               inverse(_REFINER, ["self_attn_qkv"])),
              ("transformer_blocks.", "double_blocks.", inverse(_DOUBLE, ["img_attn_qkv", "txt_attn_qkv"]))]
    out, src = {}, dict(sd)
    for key in sd:
        if key not in src:
            continue
        stem, kind = key.rsplit(".", 1)
        if stem == "norm_out.linear":
            out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap_halves(src.pop(key))
            continue
        prefix, rest, (names, fused) = "", stem, inverse(_NAMES)
        for start, original, scope in scopes:
            if match := re.fullmatch(rf"{re.escape(start)}(\d+)\.(.+)", stem):
                prefix, rest, (names, fused) = f"{original}{match[1]}.", match[2], scope
                base = f"{start}{match[1]}."
        parts = next((p for p in fused if rest in p), None)
        if parts is not None:
            out[f"{prefix}{fused[parts]}.{kind}"] = torch.cat([src.pop(f"{base}{part}.{kind}") for part in parts])
        else:
            out[f"{prefix}{names[rest]}.{kind}"] = src.pop(key)
    back = convert_checkpoint(dict(out), {})
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd), "HunyuanVideo 1.5 names do not round-trip"
    return out


def original_layout(family: str, transformer) -> dict:
    sd, config = transformer.state_dict(), transformer.config
    if family.startswith("flux3"):
        return flux3_to_bfl(sd)
    if family in ("flux", "flux-kontext"):
        return flux_to_bfl(sd, config)
    if family.startswith("hunyuanvideo15"):
        return hunyuan_video15_to_original(sd)
    if family.startswith("flux2"):
        return flux2_to_bfl(sd, config)
    if family == "sd3":
        return sd3_to_sai(sd, config)
    if family == "qwen-image":  # Comfy-Org's files keep diffusers' names, under ComfyUI's prefix
        return {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    if family.startswith("wan"):
        return wan_to_original(sd)
    if family == "z-image":
        return z_image_to_original(sd)
    if family == "krea2":
        return krea2_to_original(sd)
    return pixart_to_original(sd, config, PIXART_TOKENS[family], transformer.pos_embed.pos_embed)
