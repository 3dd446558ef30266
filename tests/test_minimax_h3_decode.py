"""MiniMax-H3 decoded on a real 2-rank pool equals diffusers' own decode steps in one process (fp32, 1e-4).

The tiny model's VAEs are diffusers' own classes at the released geometry: the video VAE decodes 17-frame chunks,
each spatially tiled by itself, so every decoder call (a tile of a chunk) is a tile the pool spreads over the ranks;
the audio VAE is mono, its BigVGAN decoder the vocoder, and takes a sample's two stereo channels as two batch items.
A 2-rank Ulysses pool samples the shortest video (124 frames at 64×64: 37 latent frames, 7 chunks of one tile) and
decodes both streams in one job; a second decode of seeded 256×256 latents (one chunk, 3×3 spatial tiles) splits a
frame. References: `MiniMaxH3VideoDecodeStep` (with the VAE tiled as the pool tiles it) and `MiniMaxH3AudioDecodeStep`.
Controls: the waveform with its stereo channels swapped, and the one-process decode with one rank-1 tile missing.
Audio latents in ComfyUI's axes are refused in one line.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from parallel.loading import tiny_models
from parallel.model_executor import vae_decode

from workers.client import JobFailed
from xdit_test_helpers import TOLERANCE

FAMILY, STEPS, SIZE = "minimax-h3", 4, 64
BIG = (1, 24, 7, 16, 16)  # 22 frames at 256×256: one chunk of 3×3 tiles


def decode_step(block: str, components: dict, **inputs) -> torch.Tensor:
    """One of diffusers' own MiniMax-H3 decoder blocks run by itself, in one process."""
    from diffusers.modular_pipelines.minimax_h3 import decoders

    pipeline = getattr(decoders, block)().init_pipeline()
    pipeline.update_components(**components)
    with torch.no_grad():
        return pipeline(**inputs, output="videos" if "Video" in block else "audio")


def reference_video(vae, latents: torch.Tensor, world: int, missing: int | None = None) -> torch.Tensor:
    """The video decode step's frames [B, T, 3, H, W] in [0, 1], the VAE tiled as the pool tiles it for `world` ranks;
    `missing`: that decoder call gives zeros (one tile never arriving)."""
    vae_decode.fit_tiles(vae, latents, world)
    stand_in = vae_decode._Dispatch(vae.decoder, lambda tile: tile != missing, None)
    with vae_decode._decoder(vae, stand_in) if missing is not None else contextlib.nullcontext():
        return decode_step("MiniMaxH3VideoDecodeStep", {"vae": vae}, latents=latents, output_type="pt")


def as_frames(images: torch.Tensor) -> torch.Tensor:
    """The pool's [B, 3, T, H, W] in [-1, 1] as the decode step's frames."""
    return (images / 2 + 0.5).permute(0, 2, 1, 3, 4)


@pytest.fixture(scope="module")
def decoded(video_model_dirs, tmp_path_factory):
    from pool_helpers import serving

    model = video_model_dirs[FAMILY]
    inputs = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE)
    big = torch.randn(BIG, generator=torch.Generator().manual_seed(5))
    with serving(model, tmp_path_factory.mktemp("h3pool"), "--nproc", "2", "--ulysses-degree", "2") as client:
        outputs = client.sample_outputs(inputs, {"steps": STEPS, "guidance_scale": 1.0, "height": SIZE, "width": SIZE})
        reply = client.decode_streams({"latents": outputs["latents"], "audio": outputs["audio"]})
        big_frames, big_info = client.decode(big)
        with pytest.raises(JobFailed) as refused:  # ComfyUI's audio axes [B, 32, 2, L], not the pipeline's
            client.decode_audio(outputs["audio"].transpose(1, 2))
    assert "[batch, 2 stereo channels, 32, audio latents], got [1, 32, 2, 207]" in str(refused.value)
    return outputs, reply, (big, big_frames, big_info), vaes(model)


def vaes(model) -> object:
    """The pool's folder's VAEs, loaded by diffusers as the modular pipeline loads its components."""
    from diffusers import ModularPipeline

    pipeline = ModularPipeline.from_pretrained(str(model))
    pipeline.load_components(names=["vae", "audio_vae"])
    return pipeline


def test_audio_on_the_pool_equals_the_pipelines_audio_decode_step(decoded):
    outputs, reply, _, pipeline = decoded
    waveform = reply.tensors["audio"]
    own = torch.cat([decode_step("MiniMaxH3AudioDecodeStep", {"audio_vae": pipeline.audio_vae}, audio_latents=sample)
                     for sample in outputs["audio"]])
    assert waveform.shape == own.shape == (1, 2, outputs["audio"].shape[-1] * 800)
    assert (waveform - own).abs().max().item() <= TOLERANCE
    assert reply.params["sample_rate"] == 32000
    assert (own[:, 0] - own[:, 1]).abs().max().item() > 100 * TOLERANCE  # two channels, not one twice
    assert (waveform - own.flip(1)).abs().max().item() > 100 * TOLERANCE  # control: the stereo channels swapped


@pytest.mark.parametrize("which", ["sampled", "256px"])
def test_video_across_2_ranks_equals_the_one_process_tiled_decode(decoded, which):
    outputs, reply, big, pipeline = decoded
    latents, images, info = (outputs["latents"], reply.tensors["images"], reply.params) if which == "sampled" else big
    expected = reference_video(pipeline.vae, latents, 2)
    frames = as_frames(images)
    frame_count = (latents.shape[2] - 2) // 5 * 17 + 5  # 5n+2 latent frames hold 17n+5
    assert frames.shape == expected.shape == (1, frame_count, 3, *(side * 16 for side in latents.shape[-2:]))
    assert (frames - expected).abs().max().item() <= TOLERANCE
    assert expected.std().item() > 0.05  # frames, not a clamped constant
    assert info["tiles"] == (7 if which == "sampled" else 9)
    assert sum(r["tiles"] for r in info["ranks"]) == info["tiles"] and all(r["tiles"] > 0 for r in info["ranks"])
    missing = reference_video(pipeline.vae, latents, 2, missing=1)  # control: rank 1's first tile never arrives
    assert (frames - missing).abs().max().item() > 100 * TOLERANCE
