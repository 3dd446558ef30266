"""LoRA on parallel layouts through the pool: equal to diffusers' own pipeline with the LoRA fused,
removable exactly, switchable without reloading the model, clear errors for bad files."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from pool_helpers import PARAMS, free_endpoint, idle_client, serving, start_serve, stop_serve
from workers.client import JobFailed
from xdit_test_helpers import TOLERANCE, diffusers_latents

FLUX_PARAMS = {**PARAMS, "guidance_scale": 3.5}
RANK = 4


def peft_lora(path, seed: int, blocks=("transformer_blocks.0", "single_transformer_blocks.1")) -> str:
    """A diffusers/PEFT-format LoRA for the tiny Flux (random A and B, so it changes the output)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for block in blocks:
        for layer in ("attn.to_q", "attn.to_k", "attn.to_v"):
            weights[f"transformer.{block}.{layer}.lora_A.weight"] = torch.randn(RANK, 64, generator=g) * 0.3
            weights[f"transformer.{block}.{layer}.lora_B.weight"] = torch.randn(64, RANK, generator=g) * 0.3
    save_file(weights, path)
    return str(path)


def kohya_lora(path, seed: int) -> str:
    """A Kohya-format Flux LoRA (fused qkv of the double blocks), converted by diffusers on load."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(2):
        for part, out in (("img_attn_qkv", 192), ("txt_attn_qkv", 192), ("img_attn_proj", 64)):
            weights[f"lora_unet_double_blocks_{i}_{part}.lora_down.weight"] = torch.randn(RANK, 64, generator=g) * 0.3
            weights[f"lora_unet_double_blocks_{i}_{part}.lora_up.weight"] = torch.randn(out, RANK, generator=g) * 0.3
            weights[f"lora_unet_double_blocks_{i}_{part}.alpha"] = torch.tensor(float(RANK))
    save_file(weights, path)
    return str(path)


def bfl_and_peft_lora(bfl_path, peft_path, seed: int) -> tuple[str, str]:
    """The same Flux LoRA in BFL's layout (fused q/k/v, single-block linear1) and split for diffusers."""
    g = torch.Generator().manual_seed(seed)
    bfl, peft = {}, {}
    a, b = torch.randn(RANK, 64, generator=g) * 0.3, torch.randn(192, RANK, generator=g) * 0.3
    bfl["diffusion_model.double_blocks.1.img_attn.qkv.lora_A.weight"] = a
    bfl["diffusion_model.double_blocks.1.img_attn.qkv.lora_B.weight"] = b
    for target, part in zip(("to_q", "to_k", "to_v"), b.split(64)):
        peft[f"transformer.transformer_blocks.1.attn.{target}.lora_A.weight"] = a.clone()
        peft[f"transformer.transformer_blocks.1.attn.{target}.lora_B.weight"] = part.clone()
    mlp = 64 * 4
    a, b = torch.randn(RANK, 64, generator=g) * 0.3, torch.randn(192 + mlp, RANK, generator=g) * 0.3
    bfl["diffusion_model.single_blocks.0.linear1.lora_A.weight"] = a
    bfl["diffusion_model.single_blocks.0.linear1.lora_B.weight"] = b
    for target, part in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), b.split([64, 64, 64, mlp])):
        peft[f"transformer.single_transformer_blocks.0.{target}.lora_A.weight"] = a.clone()
        peft[f"transformer.single_transformer_blocks.0.{target}.lora_B.weight"] = part.clone()
    save_file(bfl, bfl_path)
    save_file(peft, peft_path)
    return str(bfl_path), str(peft_path)


def peft_lora_for(transformer, path, layers: tuple[str, ...], seed: int = 5) -> str:
    """A PEFT LoRA for `transformer`'s Linear layers named `layers`, of their own shapes (random A and B)."""
    return peft_lora_on({"transformer": transformer}, path, tuple(f"transformer.{layer}" for layer in layers), seed)


def peft_lora_on(parts: dict, path, layers: tuple[str, ...], seed: int = 5) -> str:
    """A PEFT LoRA for the Linear layers named `layers` ("<part>.<layer>", the part a pipeline attribute in `parts`:
    LTX-2's text connectors beside its transformer), of their own shapes (random A and B)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name in layers:
        part, _, layer = name.partition(".")
        linear = parts[part].get_submodule(layer)
        weights[f"{name}.lora_A.weight"] = torch.randn(RANK, linear.in_features, generator=g) * 0.3
        weights[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, RANK, generator=g) * 0.3
    save_file(weights, path)
    return str(path)


def pixart_lora(path) -> str:
    """A LoRA for PixArt's layer names (attn1 = self-attention), which Flux does not have."""
    g = torch.Generator().manual_seed(9)
    weights = {"transformer.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.randn(RANK, 64, generator=g),
               "transformer.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.randn(64, RANK, generator=g)}
    save_file(weights, path)
    return str(path)


def fuse_loras(pipeline, loras: list[tuple[str, float]], components: tuple[str, ...] = ("transformer",), **load):
    """diffusers' own LoRA path: load each file (`load`: its loader's options), weight them, fuse them into the
    weights of `components` (diffusers fuses the transformer alone by default); the pipeline back."""
    names = [f"l{i}" for i in range(len(loras))]
    for name, (path, _) in zip(names, loras):
        pipeline.load_lora_weights(path, adapter_name=name, **load)
    if names:
        pipeline.set_adapters(names, adapter_weights=[strength for _, strength in loras])
        pipeline.fuse_lora(components=list(components), adapter_names=names, lora_scale=1.0)
        pipeline.unload_lora_weights()
    return pipeline


def fused_reference(model_dir, inputs, loras: list[tuple[str, float]]) -> torch.Tensor:
    pipeline = fuse_loras(DiffusionPipeline.from_pretrained(model_dir), loras)
    return diffusers_latents(pipeline, **inputs, num_inference_steps=4, guidance_scale=3.5, height=64, width=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    corrupt = root / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    bfl, bfl_as_peft = bfl_and_peft_lora(root / "bfl.safetensors", root / "bfl_as_peft.safetensors", 4)
    return {"peft": peft_lora(root / "peft.safetensors", 1), "kohya": kohya_lora(root / "kohya.safetensors", 2),
            "bfl": bfl, "bfl_as_peft": bfl_as_peft,
            "pixart": pixart_lora(root / "pixart.safetensors"), "corrupt": str(corrupt), "missing": str(root / "nope.safetensors")}


@pytest.mark.parametrize("layout", [("--ulysses-degree", "2"), ("--pipefusion-degree", "2", "--warmup-steps", "4"),
                                    ("--ulysses-degree", "2", "--shard-weights")],
                         ids=["ulysses2", "pipefusion2", "ulysses2-shard-weights"])
def test_lora_on_a_parallel_pool(tiny_model_dirs, files, tmp_path, layout):
    model = tiny_model_dirs["flux"]
    inputs = tiny_models.make_inputs("flux", negative=False)
    endpoint = free_endpoint()
    process = start_serve(model, endpoint, "--nproc", "2", *layout, log=tmp_path / "serve.log")
    try:
        client, _ = idle_client(endpoint)
        base = client.sample(inputs, FLUX_PARAMS)
        with_peft = client.sample(inputs, {**FLUX_PARAMS, "loras": [{"path": files["peft"], "strength": 0.7}]})
        assert (with_peft - fused_reference(model, inputs, [(files["peft"], 0.7)])).abs().max() <= TOLERANCE
        assert (with_peft - base).abs().max() > 100 * TOLERANCE  # the LoRA really changes the result

        assert torch.equal(client.sample(inputs, FLUX_PARAMS), base)  # removed: the base model exactly

        stack = [{"path": files["peft"], "strength": 0.5}, {"path": files["kohya"], "strength": 1.2}]
        stacked = client.sample(inputs, {**FLUX_PARAMS, "loras": stack})
        expected = fused_reference(model, inputs, [(files["peft"], 0.5), (files["kohya"], 1.2)])
        assert (stacked - expected).abs().max() <= TOLERANCE

        from_bfl = client.sample(inputs, {**FLUX_PARAMS, "loras": [{"path": files["bfl"], "strength": 0.9}]})
        assert (from_bfl - fused_reference(model, inputs, [(files["bfl_as_peft"], 0.9)])).abs().max() <= TOLERANCE

        status = client.status()
        assert status["loads"] == {"pipeline": 1, "lora": 3} and status["restarts"] == 0  # no model reload

        for bad, message in ((files["pixart"], "is not a LoRA for this FluxTransformer2DModel"),
                             (files["corrupt"], "is not a readable LoRA file"),
                             (files["missing"], "does not exist")):
            with pytest.raises(JobFailed, match=message):
                client.sample(inputs, {**FLUX_PARAMS, "loras": [{"path": bad, "strength": 1.0}]})
        assert client.status()["restarts"] == 0
        assert torch.equal(client.sample(inputs, FLUX_PARAMS), base)
        client.close()
    finally:
        stop_serve(process)


# Qwen-Image's transformer is Qwen-Image-Edit's too; FLUX.2 [klein]'s is [dev]'s (FLUX.1 Kontext's is Flux's, above)
FAMILY_LORAS = {
    "qwen-image": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj", "transformer_blocks.1.img_mlp.net.2"),
    "flux2-klein": ("transformer_blocks.0.attn.to_k", "transformer_blocks.0.ff.linear_in",
                    "single_transformer_blocks.0.attn.to_qkv_mlp_proj"),
}


@pytest.mark.parametrize("family", FAMILY_LORAS)
def test_lora_on_the_newer_families_equals_diffusers_fused(tiny_model_dirs, tmp_path, family):
    """xDiT LoRA on a Qwen-Image or FLUX.2 pool (Ulysses 2; double-stream, feed-forward and fused single-block layers)
    equals diffusers' own pipeline with the LoRA fused, and is removed exactly."""
    model = tiny_model_dirs[family]
    pipeline = DiffusionPipeline.from_pretrained(model)
    lora = peft_lora_for(pipeline.transformer, tmp_path / "lora.safetensors", FAMILY_LORAS[family])
    inputs = tiny_models.make_inputs(family, negative=False)
    params = {**PARAMS, "guidance_scale": 1.0}
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        base = client.sample(inputs, params)
        with_lora = client.sample(inputs, {**params, "loras": [{"path": lora, "strength": 0.8}]})
        assert torch.equal(client.sample(inputs, params), base)
    call = {**inputs, "num_inference_steps": PARAMS["steps"], "guidance_scale": 1.0, "height": 64, "width": 64}
    assert (base - diffusers_latents(pipeline, family, **call)).abs().max().item() <= TOLERANCE
    fused = diffusers_latents(fuse_loras(pipeline, [(lora, 0.8)]), family, **call)
    assert (with_lora - fused).abs().max().item() <= TOLERANCE
    assert (with_lora - base).abs().max().item() > 100 * TOLERANCE  # the LoRA takes part


# video and audio streams of each; LTX-2's audio-video cross attention both ways (video queries on audio keys, and
# back), and its text connectors (diffusers' LTX-2 loader puts a LoRA's `connectors.` weights there)
AV_LORAS = {
    "ltx2": tuple(f"transformer.{layer}" for layer in (
        "transformer_blocks.0.attn1.to_q", "transformer_blocks.0.audio_attn1.to_v",
        "transformer_blocks.0.audio_to_video_attn.to_k", "transformer_blocks.1.video_to_audio_attn.to_q",
        "transformer_blocks.1.ff.net.2", "transformer_blocks.1.audio_ff.net.0.proj")),
    "minimax-h3": ("transformer.proj_in", "transformer.audio_proj_in", "transformer.transformer_blocks.0.attn.to_q",
                   "transformer.transformer_blocks.1.ff.net.2"),
}
LTX2_CONNECTORS = ("connectors.video_connector.transformer_blocks.0.attn1.to_v", "connectors.audio_text_proj_in")


def ltx2_original_layout(peft_path, path) -> str:
    """The same LTX-2 LoRA in the LTX-2 trainer's layout (`diffusion_model.`, the connectors under
    `text_embedding_projection.` with `aggregate_embed`), which diffusers' LTX-2 loader converts on load."""
    renamed = {}
    for key, value in load_file(peft_path).items():
        if key.startswith("transformer."):
            renamed["diffusion_model." + key.removeprefix("transformer.")] = value
        else:
            key = key.removeprefix("connectors.").replace("text_proj_in", "aggregate_embed")
            renamed["text_embedding_projection." + key] = value
    save_file(renamed, path)
    return str(path)


def _av_job(family: str):
    """(inputs, pool job params, diffusers' reference of a pipeline: (video, audio)) as tests/test_ltx2.py and
    tests/test_minimax_h3.py run them."""
    import test_ltx2
    import test_minimax_h3

    if family == "minimax-h3":
        t = test_minimax_h3
        inputs = tiny_models.make_inputs(family, height=t.SIZE, width=t.SIZE, num_frames=t.FRAMES)
        return inputs, {"steps": t.STEPS, "guidance_scale": 1.0, "height": t.SIZE, "width": t.SIZE}, \
            lambda pipeline: t.reference(pipeline, inputs)
    t = test_ltx2
    inputs = tiny_models.make_inputs(family, height=t.HEIGHT, width=t.WIDTH, num_frames=t.FRAMES)
    params = {"steps": t.STEPS, "guidance_scale": t.GUIDANCE, "height": t.HEIGHT, "width": t.WIDTH,
              "call": {"frame_rate": t.RATE, "stg_block": 1}}
    call = {**t.CALL, "spatio_temporal_guidance_blocks": [1]}
    del call["stg_block"]
    return inputs, params, lambda pipeline: diffusers_latents(pipeline, **inputs, **call, all_outputs=True)


@pytest.mark.parametrize("family", AV_LORAS)
def test_lora_on_the_audio_video_families_equals_diffusers_fused(video_model_dirs, tmp_path, family):
    """LoRA on an LTX-2 or MiniMax-H3 pool (Ulysses 2) equals diffusers' own pipeline with the LoRA fused, its video
    and its audio each, and is removed exactly. LTX-2's LoRA changes its text connectors too (fused as diffusers'
    loader loads them): the same LoRA without them misses by far; in the LTX-2 trainer's layout it equals it."""
    from xdit_test_helpers import load_pipeline_folder

    model, names = video_model_dirs[family], ("latents", "audio")
    pipeline = load_pipeline_folder(model)
    parts = {"transformer": pipeline.transformer, **({"connectors": pipeline.connectors} if family == "ltx2" else {})}
    layers = AV_LORAS[family] + (LTX2_CONNECTORS if family == "ltx2" else ())
    loras = {"peft": peft_lora_on(parts, tmp_path / "lora.safetensors", layers)}
    if family == "ltx2":
        loras["original"] = ltx2_original_layout(loras["peft"], tmp_path / "original.safetensors")
    inputs, params, reference = _av_job(family)
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        base = client.sample_outputs(inputs, params)
        ours = {kind: client.sample_outputs(inputs, {**params, "loras": [{"path": path, "strength": 0.8}]})
                for kind, path in loras.items()}
        assert all(torch.equal(client.sample_outputs(inputs, params)[name], base[name]) for name in names)
    for name, expected in zip(names, reference(pipeline)):
        assert (base[name] - expected).abs().max().item() <= TOLERANCE, name
    fused = dict(zip(names, reference(fuse_loras(pipeline, [(loras["peft"], 0.8)], tuple(parts)))))
    for kind, name in ((kind, name) for kind in ours for name in names):
        error = (ours[kind][name] - fused[name]).abs().max().item()
        assert error <= TOLERANCE, f"{family} {kind} {name}: max |pool - fused| {error:.3g}"
        assert (ours[kind][name] - base[name]).abs().max().item() > 100 * TOLERANCE, name  # the LoRA takes part
    if family == "ltx2":  # the negative control: the same LoRA without its connectors' weights
        transformer_only = peft_lora_on(parts, tmp_path / "transformer_only.safetensors", AV_LORAS[family])
        for name, miss in zip(names, reference(fuse_loras(load_pipeline_folder(model), [(transformer_only, 0.8)]))):
            assert (ours["peft"][name] - miss).abs().max().item() > 100 * TOLERANCE, name


def test_lora_of_minimax_h3_references_goes_into_transformer_ref(video_model_dirs, tmp_path):
    """On a MiniMax-H3 pool (Ulysses 2) sampling references (ref2va), which run on `transformer_ref` alone: a LoRA of
    `transformer_ref.` weights (diffusers routes a LoRA to the partition its prefix names), and a LoRA of
    `transformer.` weights targeted at `transformer_ref` (the xDiT LoRA node's target; diffusers'
    `load_into_transformer_ref=True`), each equal diffusers' ref2va blocks with it fused into `transformer_ref` and
    take part. Control: the `transformer.` LoRA with the default target goes into `transformer` and leaves ref2va
    as it was. The pool's status counts both partitions' parameter bytes on each rank (each holds both whole)."""
    import test_minimax_h3 as h3

    model = video_model_dirs["minimax-h3"]
    pipeline = h3.loaded(model)
    held = {name: sum(p.numel() * p.element_size() for p in pipeline.components[name].parameters())
            for name in ("transformer", "transformer_ref")}
    lora = peft_lora_on({"transformer_ref": pipeline.transformer_ref}, tmp_path / "ref.safetensors",
                        tuple(layer.replace("transformer.", "transformer_ref.", 1) for layer in AV_LORAS["minimax-h3"]))
    plain = peft_lora_on({"transformer": pipeline.transformer}, tmp_path / "plain.safetensors", AV_LORAS["minimax-h3"],
                         seed=6)
    inputs = h3.reference_inputs(tiny_models.make_inputs("minimax-h3", height=h3.SIZE, width=h3.SIZE,
                                                         num_frames=h3.FRAMES))
    inputs = {name: tensor.float() if name.endswith(("_kinds", "_sizes")) else tensor  # the pool takes floats
              for name, tensor in inputs.items()}
    params = {"steps": h3.STEPS, "guidance_scale": 1.0, "height": h3.SIZE, "width": h3.SIZE, "call": {"seed": h3.SEED}}
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        memory = client.status()["memory"]
        base = client.sample_outputs(inputs, params)
        ours = client.sample_outputs(inputs, {**params, "loras": [{"path": lora, "strength": 0.8}]})
        targeted = client.sample_outputs(inputs, {**params, "loras": [
            {"path": plain, "strength": 0.8, "expert": "transformer_ref"}]})
        untargeted = client.sample_outputs(inputs, {**params, "loras": [{"path": plain, "strength": 0.8}]})
        with pytest.raises(JobFailed, match="has no transformer_2; its transformers are transformer, transformer_ref"):
            client.sample_outputs(inputs, {**params, "loras": [{"path": plain, "strength": 0.8, "expert": "transformer_2"}]})
    assert [rank["parameter_bytes"] for rank in memory] == [sum(held.values())] * 2, (memory, held)
    names = ("latents", "audio")
    expected = dict(zip(names, h3.ref2va_reference(pipeline, inputs)))
    fused = dict(zip(names, h3.ref2va_reference(fuse_loras(pipeline, [(lora, 0.8)], ("transformer_ref",)), inputs)))
    into_ref = fuse_loras(h3.loaded(model), [(plain, 0.8)], ("transformer_ref",), load_into_transformer_ref=True)
    fused_plain = dict(zip(names, h3.ref2va_reference(into_ref, inputs)))
    for name in names:
        assert (base[name] - expected[name]).abs().max().item() <= TOLERANCE, name
        for got, want, what in ((ours, fused, "transformer_ref."), (targeted, fused_plain, "targeted transformer.")):
            error = (got[name] - want[name]).abs().max().item()
            assert error <= TOLERANCE, f"ref2va {name}, {what} LoRA: max |pool - fused| {error:.3g}"
            assert (got[name] - base[name]).abs().max().item() > 100 * TOLERANCE, name  # the LoRA takes part
        assert torch.equal(untargeted[name], base[name]), name  # into `transformer`, which ref2va does not run
