"""Rebuild example_workflows/*.json in the real ComfyUI frontend (run when a node's inputs change): ComfyUI 0.33's, the
test bed every browser test runs on, with its own empty-latent nodes where it has them (FLUX.2, HunyuanVideo 1.5).

    .venv/bin/python tests/browser/build_example_workflows.py

The graph is made with the frontend's own LiteGraph (createNode, connect, widget values) and saved with
`app.graph.serialize()`, so the files are exactly what ComfyUI itself saves. Needs what the browser
tests need (see tests/test_comfyui_browser.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # tests/, the repo

from comfyui_page import scratch_page  # noqa: E402
from xdit_test_helpers import ROOT  # noqa: E402

EXAMPLES = {  # file stem: (family, empty latent node, cfg, what the example says about itself)
    "xdit_pixart_alpha": ("pixart-alpha", "EmptyLatentImage", 4.5, "PixArt-α"),
    "xdit_pixart_sigma": ("pixart-sigma", "EmptyLatentImage", 4.5, "PixArt-Σ"),
    "xdit_sd3": ("sd3", "EmptySD3LatentImage", 4.5, "Stable Diffusion 3"),
    "xdit_flux": ("flux", "EmptySD3LatentImage", 1.0, "Flux (cfg 1: distilled guidance only)"),
    "xdit_wan": ("wan22", "EmptyHunyuanLatentVideo", 5.0, "Wan 2.2 text-to-video"),
    "xdit_qwen_image": ("qwen-image", "EmptySD3LatentImage", 4.0, "Qwen-Image (cfg: true CFG with the negative prompt)"),
    "xdit_z_image": ("z-image", "EmptySD3LatentImage", 1.0,
                     "Z-Image (cfg 1 as Z-Image-Turbo samples; above 1: classifier-free guidance)"),
    "xdit_flux2_klein": ("flux2-klein", "EmptyFlux2LatentImage", 4.0,
                         "FLUX.2 [klein] (cfg: classifier-free guidance of the base model; ComfyUI's own FLUX.2 latent: "
                         "128 channels at 1/16 size)"),
    "xdit_flux2_dev": ("flux2-dev", "EmptyFlux2LatentImage", 1.0,
                       "FLUX.2 [dev] (cfg 1: its guidance is distilled, FluxGuidance's default 4; ComfyUI's own FLUX.2 "
                       "latent)"),
    "xdit_hunyuan_video15": ("hunyuanvideo15", "EmptyHunyuanVideo15Latent", 6.0,
                             "HunyuanVideo 1.5 text-to-video (9 frames; ComfyUI's own HunyuanVideo 1.5 latent: 32 "
                             "channels at 1/16 size)"),
    "xdit_flux_kontext": ("flux-kontext", "EmptySD3LatentImage", 1.0,
                          "FLUX.1 Kontext editing a first sampler's image (your own: LoadImage → VAEEncode)"),
    "xdit_qwen_image_edit": ("qwen-image-edit", "EmptySD3LatentImage", 4.0,
                             "Qwen-Image-Edit: the prompts encoded with ComfyUI's example.png, whose latents become "
                             "the reference (your own: another LoadImage)"),
    "xdit_model_ksampler": ("sd3", "EmptySD3LatentImage", 4.5, "ComfyUI's KSampler on the pool through xDiT Model (SD3)"),
    "xdit_flux3": ("flux3", "XDiTEmptyLatent", 4.0,
                   "FLUX 3 [klein] (cfg: its guider's classifier-free guidance; ComfyUI 0.33.0 has no FLUX 3 nodes: "
                   "xDiT Empty Latent makes its latent, FLUX.2's, 128 channels at 1/16 size)"),
    "xdit_krea2": ("krea2", "EmptySD3LatentImage", 3.0,
                   "Krea 2 (cfg: classifier-free guidance with the negative; the Turbo model samples at cfg 1)"),
    "xdit_qwen_image21": ("qwen-image-2.1", "XDiTEmptyLatent", 4.0,
                          "Qwen-Image 2.1 (cfg: true CFG with the negative; ComfyUI 0.33.0 has no Qwen-Image 2.1 nodes: "
                          "xDiT Empty Latent makes its latent, 64 channels at 1/16 size)"),
}
# video with sound: ComfyUI's own AV latent nodes; LTX-2's text by the pool's Gemma, MiniMax-H3's by ComfyUI's own
# encoder (the pool's H3 pipeline samples; its text encoder step is not run); both decoded on the pool
AV_EXAMPLES = {
    "xdit_ltx2": ("ltx2", "EmptyLTXVLatentVideo", 4.0,
                  "LTX-2.3 text-to-video with sound (17 frames at 24 fps; the audio VAE from the LTX-2.3 checkpoint; "
                  "xDiT VAE Decode decodes the video on the ranks and the sound with the pool's audio VAE and vocoder)"),
    "xdit_minimax_h3": ("minimax-h3", "EmptyMiniMaxH3LatentAV", 1.0,
                        "MiniMax-H3 text-to-video with sound (124 frames = 5 s at 24 fps, its shortest; cfg 1: its "
                        "guidance is distilled; ComfyUI's own MiniMax-H3 text encoder, as its template; xDiT VAE "
                        "Decode decodes the video on the ranks and the sound with the pool's audio VAE)"),
}
REFERENCE = {"xdit_flux_kontext"}  # edit models: a first sampler's LATENT → ReferenceLatent on the positive
IMAGE = {"xdit_qwen_image_edit": "turn it into a watercolor painting, soft washes of colour"}  # prompt with a picture
KSAMPLER = {"xdit_model_ksampler"}  # ComfyUI's own KSampler on xDiT Model instead of xDiT Sampler

# video frames, where the empty latent node takes them with a default of 1 (or MiniMax-H3's 124, its shortest)
LENGTH = {"xdit_hunyuan_video15": 9, "xdit_minimax_h3": 124}

# The end of a video-with-sound example: the AV latent decoded on the pool (video and sound: xDiT VAE Decode), CreateVideo
# joins frames and sound, SaveVideo writes them.
SAVE_VIDEO = """    const saveVideo = (av, pool, sampler, add) => {
        const clip = add('CreateVideo', [1130, 120], { fps: 24 });
        const decode = add('XDiTVAEDecode', [810, 500], { tile_size: 0 });
        pool.connect(0, decode, 0);
        sampler.connect(0, decode, 1);
        decode.connect(0, clip, clip.findInputSlot('images'));
        decode.connect(1, clip, clip.findInputSlot('audio'));
        const save = add('SaveVideo', [1420, 120], { filename_prefix: `video/xdit_${av.replace('-', '_')}`, format: 'auto',
                                                     codec: 'auto' });
        clip.connect(0, save, 0);
    };
"""

BUILD = """async ({ family, empty, cfg, name, stem, id, reference, ksampler, length, image, av }) => {
""" + SAVE_VIDEO + """    app.graph.clear();
    const add = (type, [x, y], values = {}, extra = {}) => {
        const node = LiteGraph.createNode(type);
        node.pos = [x, y];
        app.graph.add(node);
        for (const [name, value] of Object.entries(values)) {
            const widget = node.widgets.find((w) => w.name === name);
            if (!widget) throw new Error(`${type} has no widget ${name}`);
            widget.value = value;
        }
        Object.assign(node, extra);
        return node;
    };
    const colours = LGraphCanvas.node_colors;
    const pool = add('XDiTPool', [40, 120], {
        model: `xdit-tiny-${family} (built-in, no download)`, nproc: 2, ulysses_degree: 2, ring_degree: 1,
        pipefusion_degree: 1, num_patches: 0, warmup_steps: 1, cfg_parallel: false, dp_degree: 1,
        text_encoders: av !== 'minimax-h3', dtype: 'auto', devices: '', threads_per_rank: 1, endpoint: '' });
    const h3 = av === 'minimax-h3';  // ComfyUI's own text encoder (CLIPLoader → CLIPTextEncode), as its template
    const clip = h3 && add('CLIPLoader', [40, 620], { clip_name: 'qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors',
        type: 'minimax', device: 'default' });
    const encode = (pos, text, title, colour) => add(h3 ? 'CLIPTextEncode' : 'XDiTTextEncode', pos, { text },
        { title: `${h3 ? 'CLIP' : 'xDiT'} Text Encode (${title})`, color: colour.color, bgcolor: colour.bgcolor });
    const positive = encode([360, 120], image ?? 'a lighthouse on a cliff at sunset, dramatic clouds',
                            'positive', colours.green);
    const negative = encode([360, 370], 'blurry, low quality', 'negative', colours.red);
    let latent, texts = [positive, negative];
    if (av === 'ltx2') {  // EmptyLTXVLatentVideo + LTXVEmptyLatentAudio → LTXVConcatAVLatent; the frame rate on the text
        const video = add(empty, [360, 630], { width: 128, height: 128, length: 17, batch_size: 1 });
        const audioVae = add('LTXVAudioVAELoader', [40, 620], { ckpt_name: 'ltx-2.3-22b-dev-fp8.safetensors' });
        const audio = add('LTXVEmptyLatentAudio', [40, 760], { frames_number: 17, frame_rate: 24, batch_size: 1 });
        audioVae.connect(0, audio, audio.findInputSlot('audio_vae'));
        latent = add('LTXVConcatAVLatent', [360, 880]);
        video.connect(0, latent, 0);
        audio.connect(0, latent, 1);
        const rate = add('LTXVConditioning', [620, 500], { frame_rate: 24 });
        positive.connect(0, rate, 0);
        negative.connect(0, rate, 1);
        texts = [{ node: rate, slot: 0 }, { node: rate, slot: 1 }];
    } else {
        const size = { width: 128, height: 128, ...(h3 ? {} : { batch_size: 1 }), ...(length ? { length } : {}) };
        latent = add(empty, [360, 630], size);
    }
    const addSampler = (pos, seed, extra) => add('XDiTSampler', pos, { seed, control_after_generate: 'fixed', steps: 8,
        cfg, sampler: 'default', denoise: 1.0, preview: true }, extra);
    const wire = (node) => [pool, ...texts, latent].forEach((input, slot) =>
        input.node ? input.node.connect(input.slot, node, slot) : input.connect(0, node, slot));
    const sampler = ksampler
        ? add('KSampler', [810, 120], { seed: 42, control_after_generate: 'fixed', steps: 8, cfg,
            sampler_name: 'euler', scheduler: 'simple', denoise: 1.0 })
        : addSampler([810, 120], 42);
    const save = !av && add('SaveLatent', [1130, 120], { filename_prefix: `latents/${stem}` });
    for (const text of [positive, negative]) (h3 ? clip : pool).connect(0, text, 0);
    if (empty === 'XDiTEmptyLatent') pool.connect(0, latent, 0);
    if (ksampler) {
        const model = add('XDiTModel', [40, 560]);
        pool.connect(0, model, 0);
        [model, positive, negative, latent].forEach((input, slot) => input.connect(0, sampler, slot));
    } else {
        wire(sampler);
    }
    if (av) saveVideo(av, pool, sampler, add);
    else sampler.connect(0, save, 0);
    if (image) {  // the picture to edit, which xDiT Text Encode encodes with each prompt
        const picture = add('LoadImage', [40, 680], { image: 'example.png' }, { title: 'Load Image (the picture to edit)' });
        picture.connect(0, positive, positive.findInputSlot('image'));
        picture.connect(0, negative, negative.findInputSlot('image'));
    }
    if (reference) {
        const first = addSampler([810, 500], 7, { title: 'xDiT Sampler (the image to edit)' });
        const ref = add('ReferenceLatent', [1130, 500]);
        wire(first);
        positive.connect(0, ref, 0);
        first.connect(0, ref, 1);
        ref.connect(0, sampler, 1);
    }
    const group = new LiteGraph.LGraphGroup(`xDiT: ${name}, built-in tiny model on 2 ranks (Ulysses 2)`);
    group.pos = [20, 40];
    group.size = [av ? 1740 : 1420, reference || image || av ? 1020 : 740];
    app.graph.add(group);
    app.graph.id = id ?? crypto.randomUUID();
    const workflow = app.graph.serialize();
    const converted = await app.graphToPrompt();
    return { workflow, classes: Object.values(converted.output).map((n) => n.class_type) };
}"""


def main() -> None:
    with scratch_page() as (_, browser):
        for stem, (family, empty, cfg, name) in {**EXAMPLES, **AV_EXAMPLES}.items():
            path = ROOT / "example_workflows" / f"{stem}.json"
            old_id = json.loads(path.read_text()).get("id") if path.exists() else None  # keep diffs small
            spec = {"family": family, "empty": empty, "cfg": cfg, "name": name, "stem": stem, "id": old_id,
                    "reference": stem in REFERENCE, "ksampler": stem in KSAMPLER, "length": LENGTH.get(stem),
                    "image": IMAGE.get(stem), "av": family if stem in AV_EXAMPLES else None}
            result = browser.eval(BUILD, spec)
            nodes = 12 if stem == "xdit_ltx2" else 9 if stem in AV_EXAMPLES else 8 if stem in REFERENCE else \
                7 if stem in KSAMPLER | set(IMAGE) else 6
            assert len(result["classes"]) == nodes, result["classes"]
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(result["workflow"], indent=2) + "\n")
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
