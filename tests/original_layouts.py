"""diffusers transformers written back in their original single-file layouts (BFL, SAI, PixArt, Wan,
Comfy-Org's), the inverse of diffusers' converters: how the tests make the files users download."""

from __future__ import annotations

import json

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


def original_layout(family: str, transformer) -> dict:
    sd, config = transformer.state_dict(), transformer.config
    if family == "flux":
        return flux_to_bfl(sd, config)
    if family == "sd3":
        return sd3_to_sai(sd, config)
    if family == "qwen-image":  # Comfy-Org's files keep diffusers' names, under ComfyUI's prefix
        return {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    if family.startswith("wan"):
        return wan_to_original(sd)
    return pixart_to_original(sd, config, PIXART_TOKENS[family], transformer.pos_embed.pos_embed)


def fp8_scaled(weights: dict, per_layer: bool) -> tuple[dict, dict]:
    """ComfyUI's scaled fp8 file of `weights` (its 2-D weights fp8 with a per-tensor scale: the `scaled_fp8`
    marker with `scale_weight`, or per-layer `comfy_quant` JSON with `weight_scale`), and the weights it
    means, stored · scale, as ComfyUI's loader computes them."""
    stored, meant = {}, {}
    for name, weight in weights.items():
        if name.endswith(".weight") and weight.ndim == 2:
            scale = weight.abs().max().float() / 448
            fp8 = (weight.float() / scale).to(torch.float8_e4m3fn)
            layer = name.removesuffix(".weight")
            stored[name] = fp8
            if per_layer:
                stored[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                              dtype=torch.uint8)
                stored[layer + ".weight_scale"], stored[layer + ".input_scale"] = scale, torch.tensor(1.0)
            else:
                stored[layer + ".scale_weight"], stored[layer + ".scale_input"] = scale, torch.tensor(1.0)
            meant[name] = fp8.float() * scale
        else:
            stored[name] = meant[name] = weight
    if not per_layer:  # under the weights' whole-checkpoint prefix, where ComfyUI looks for it
        prefix = "model.diffusion_model." if all(k.startswith("model.diffusion_model.") for k in weights) else ""
        stored[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return stored, meant


def gguf_file(weights: dict, path, arch: str, kind: str = "Q8_0", as_diffusers: bool = False) -> dict:
    """A GGUF file of `weights` as city96's convert script writes one: the original names, 2-D weights whose rows
    divide into the type's blocks as `kind` (Q8_0, Q6_K, ...; F16 and BF16 for every 2-D weight), the rest F32.
    Returns the weights the file holds, as the gguf package dequantizes them (fp32), or with `as_diffusers`
    (Q8_0) as diffusers' GGUF layers do: each block's fp16 scale times its int8 values, rounded once to fp16.

    The gguf package quantizes only some types; the K-quants (Q6_K, Q5_K, Q4_K) get valid blocks of random codes
    with small fp16 scales instead: a file of that type, though not a quantization of `weights`."""
    import gguf
    import numpy as np

    quant = gguf.GGMLQuantizationType[kind]
    values_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[quant]
    writer = gguf.GGUFWriter(str(path), arch)
    meant = {}
    rng = np.random.default_rng(0)
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if array.ndim != 2 or array.shape[-1] % values_per_block:
            writer.add_tensor(name, array)
            meant[name] = tensor.float()
            continue
        try:
            blocks = gguf.quants.quantize(array, quant)
        except NotImplementedError:  # K-quants: random codes, then each block's fp16 scales (d, and dmin) made small
            shape = gguf.quants.quant_shape_to_byte_shape(array.shape, quant)
            blocks = rng.integers(0, 256, size=shape, dtype=np.uint8)
            per_block = blocks.reshape(-1, bytes_per_block)
            scale = np.float16(1e-3).tobytes()
            offsets = [bytes_per_block - 2] if kind == "Q6_K" else [0, 2]  # where d (and dmin) sit in the block
            for offset in offsets:
                per_block[:, offset:offset + 2] = np.frombuffer(scale, dtype=np.uint8)
        raw = {"raw_dtype": quant} if blocks.dtype == np.uint8 else {}
        writer.add_tensor(name, blocks, **raw, raw_shape=gguf.quants.quant_shape_to_byte_shape(array.shape, quant)
                          if raw else None)
        meant[name] = torch.from_numpy(gguf.quants.dequantize(blocks, quant).astype(np.float32)).reshape(tensor.shape)
        if as_diffusers:
            meant[name] = meant[name].to(torch.float16).float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant
