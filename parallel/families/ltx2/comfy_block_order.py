"""ComfyUI >= 0.31's block order for LTX-2 (its LTXAV) on diffusers' untouched LTX2VideoTransformerBlock, for the model
calls that ask (`v2a_reads_updated_video`).

ComfyUI's "Speedup LTX and Wan" (PR 15138, commit 15989f87, first in 0.31.0) normalises the video again for each
block's video-to-audio attention, after that block's audio-to-video update (`vx.addcmul_(a2v_out, gate)`); Lightricks'
reference (ltx-core), ComfyUI <= 0.30 and diffusers normalise it once, before the update. A drop-in loader must give
what ComfyUI gives, so the pool takes ComfyUI's order where the call asks. Forward hooks on the block's own modules
make it, without a copy of the block's forward: the block's pre-hook keeps its cross-attention modulation inputs,
`audio_to_video_norm` sees the video before the update, `audio_to_video_attn` gives the update, and a pre-hook on
`video_to_audio_attn` replaces its keys' source with the updated video through the block's own norm, `get_mod_params`
and `video_a2v_cross_attn_scale_shift_table`. Every step is per video row, so under the sequence-parallel plan (each
rank's own rows, the video-to-audio attention merging its ranks' keys) it holds as it does whole.

The hooks go on at the first call that asks and stay; a flag read at call time leaves every other call as diffusers
runs it.

Under a noise mask (per-token video timesteps, `token_sigmas`) ComfyUI's LTXAV gates every video token's audio-to-video
update by the audio's timestep (`a_timestep_scaled.max()` expanded to the video tokens, times the cross-attention
factor) and the video-to-audio update by the video's largest; diffusers' transformer with use_cross_timestep off (the
one setting that modulates the cross-modal scale and shift per stream as ComfyUI does) gates the first by each video
token's own timestep. `a2v_gate_reads_audio_timestep` makes the first ComfyUI's: a pre-hook on `audio_time_embed`
keeps the call's audio timestep, one on `av_cross_attn_video_a2v_gate` puts it (× the same factor) in place of the
video tokens' timesteps, as many as that rank holds. The second needs nothing: the audio's timestep, which
nodes/av_calls.py requires to be the video's largest.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

ORDER = "_xdit_v2a_reads_updated_video"  # the transformer's _Order, once its hooks are on
GATE = "_xdit_a2v_gate_reads_audio_timestep"  # the transformer's _Gate, once its hooks are on
A2V_GATE = "a2v_gate_reads_audio_timestep"  # the model-call input asking for ComfyUI's audio-to-video gate


class _Order:
    """One transformer's hooks' state: whether the running call asks, and what its running block has seen."""

    def __init__(self):
        self.active = False
        self.clear()

    def clear(self) -> None:
        self.arguments, self.video, self.update = None, None, None


@contextlib.contextmanager
def v2a_reads_updated_video(transformer: torch.nn.Module, on: bool):
    """Inside, each block of the diffusers LTX2VideoTransformer3DModel `transformer` runs ComfyUI >= 0.31's order if
    `on`, diffusers' own otherwise."""
    if not on:
        yield
        return
    order = getattr(transformer, ORDER, None) or _install(transformer)
    order.active = True
    try:
        yield
    finally:
        order.active = False
        order.clear()


def _install(transformer: torch.nn.Module) -> _Order:
    order = _Order()
    for block in transformer.transformer_blocks:
        signature = inspect.signature(type(block).forward)  # the class's: hooks may wrap the instance's forward

        def arguments(block, args, kwargs, signature=signature):
            if order.active:
                order.clear()
                order.arguments = signature.bind(block, *args, **kwargs).arguments

        def video(norm, args, output):
            if order.active and order.video is None:  # the block's own call, before the update (not ours below)
                order.video = args[0]

        def update(attention, args, output):
            if order.active:
                order.update = output

        def keys(attention, args, kwargs, block=block):
            if not order.active or order.update is None:  # this block ran no audio-to-video update: nothing moved
                return None
            if "encoder_hidden_states" not in kwargs:
                raise RuntimeError("diffusers' LTX2VideoTransformerBlock no longer passes video_to_audio_attn its video "
                                   "as encoder_hidden_states: ComfyUI's block order needs comfy_block_order.py updated")
            given = order.arguments
            batch, table = given["hidden_states"].size(0), block.video_a2v_cross_attn_scale_shift_table
            gate = block.get_mod_params(table[4:, :], given["temb_ca_gate"], batch)[0].squeeze(2)
            scale, shift = block.get_mod_params(table[:4, :], given["temb_ca_scale_shift"], batch)[2:4]
            updated = block.audio_to_video_norm(order.video + gate * order.update)
            return args, {**kwargs, "encoder_hidden_states": updated * (1 + scale.squeeze(2)) + shift.squeeze(2)}

        block.register_forward_pre_hook(arguments, with_kwargs=True)
        block.audio_to_video_norm.register_forward_hook(video)
        block.audio_to_video_attn.register_forward_hook(update)
        block.video_to_audio_attn.register_forward_pre_hook(keys, with_kwargs=True)
    setattr(transformer, ORDER, order)
    return order


class _Gate:
    """One transformer's gate hooks' state: whether the running call asks, and its audio timestep."""

    def __init__(self):
        self.active, self.audio = False, None


@contextlib.contextmanager
def a2v_gate_reads_audio_timestep(transformer: torch.nn.Module, on: bool):
    """Inside, the diffusers LTX2VideoTransformer3DModel `transformer` gates each video token's audio-to-video update
    by the call's audio timestep, as ComfyUI's LTXAV does, if `on`; by its own `video_ca_timestep` otherwise."""
    if not on:
        yield
        return
    gate = getattr(transformer, GATE, None) or _install_gate(transformer)
    gate.active = True
    try:
        yield
    finally:
        gate.active, gate.audio = False, None


def _install_gate(transformer: torch.nn.Module) -> _Gate:
    gate = _Gate()
    factor = transformer.config.cross_attn_timestep_scale_multiplier / transformer.config.timestep_scale_multiplier

    def audio(embed, args):
        if gate.active:
            gate.audio = args[0]

    def video(embed, args):
        if not gate.active:
            return None
        if gate.audio is None:
            raise RuntimeError("diffusers' LTX2VideoTransformer3DModel no longer embeds the audio timestep before the "
                               "audio-to-video gate: ComfyUI's gate needs comfy_block_order.py updated")
        return (gate.audio.max().to(args[0]).expand_as(args[0]) * factor, *args[1:])

    transformer.audio_time_embed.register_forward_pre_hook(audio)
    transformer.av_cross_attn_video_a2v_gate.register_forward_pre_hook(video)
    setattr(transformer, GATE, gate)
    return gate
