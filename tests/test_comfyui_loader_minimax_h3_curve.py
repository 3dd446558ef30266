"""MiniMax-H3 in the curve form the ComfyUI templates ship (video_minimax_h3_t2v / i2v / r2v download
`minimax_h3_*_pruned_int8_convrot`): `adaln_t_table` [grid, k] in place of the time embedder, adaln projections over
the table's k coordinates without SiLU, the time embedding the table's rows interpolated at t (ComfyUI's
MiniMaxH3Model with `adaln_curve_grid`). The tiny file is written by ComfyUI's own MiniMaxH3Model of that form, and
ComfyUI's model detection reads it as the curve form (its `use_adaln_curves`); the pool loads it into diffusers'
transformer with the curve form's modules swapped in (parallel/families/minimax_h3/curve_form.py).

One model call on one rank equals ComfyUI's own model's, and the sampling part of video_minimax_h3_t2v with UNETLoader
swapped for Load Diffusion Model (xDiT Pool) on Ulysses 2 equals ComfyUI's own model on the same file, video and audio.
Negative control: the table shifted by one row (what a lookup one row off reads) misses by far more than the
tolerance. The grid is small (33 rows), so the timesteps fall between rows and the blend counts.

The templates' files are int8 too (`_int8_convrot`: comfy_quant `int8_tensorwise` with ConvRot, the table and the
norms as they are). The pool dequantizes such a file at load (parallel/loading/checkpoints/scaled.py): its call equals
ComfyUI's own model's on the weights the file means (dequantized by ComfyUI's own layers: tests/independent_readers.py),
and misses the unquantized file's by far more than the tolerance. ComfyUI's model on the int8 file itself differs by
more (2e-2 here): its int8 linears also quantize their inputs, row by row, which a dequantized layer does not.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from independent_readers import _read
from quantized_files import int8_tensorwise
from test_comfyui_loader import _loader
from test_comfyui_loader_minimax_h3 import COMFY_ARGS  # noqa: F401 (the comfy fixture reads the module's)
from test_comfyui_loader_minimax_h3 import CONFIG, _comfyui_file, _max_diffs, _pool_call, _streams, _template, _text
from xdit_test_helpers import TOLERANCE

CURVE = {**CONFIG, "adaln_curve_grid": 33}  # k: CONFIG's time_embed_dim (32)
FILE, SHIFTED = "tiny-minimax-h3-curve.safetensors", "tiny-minimax-h3-curve-shifted.safetensors"
PREFIX = "model.diffusion_model."
TABLE = PREFIX + "adaln_t_table"


def _shifted(path, to) -> None:
    """The file at `path` with its table's rows moved down by one (the last row first)."""
    weights = load_file(path)
    save_file({**weights, TABLE: torch.roll(weights[TABLE], 1, dims=0).contiguous()}, to)


def test_comfyuis_curve_form_model_call_equals_the_pools_on_the_same_file(comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    x, model = _comfyui_file(python, comfyui, tmp_path / FILE, tmp_path, config=CURVE)
    assert model == "MiniMaxH3 curve form"  # ComfyUI's own detection of the file
    assert not any(".time_embedder." in name for name in load_file(tmp_path / FILE))
    ours = _pool_call(tmp_path / FILE, x, x["comfy_audio_sigma"])
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the table shifted by one row
    _shifted(tmp_path / FILE, tmp_path / SHIFTED)
    shifted = _pool_call(tmp_path / SHIFTED, x, x["comfy_audio_sigma"])
    misses = {name: (shifted[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert min(misses.values()) > 1e-2, misses


def test_a_curve_form_int8_convrot_file_equals_comfyuis_model_on_the_weights_it_means(comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    x, _ = _comfyui_file(python, comfyui, tmp_path / FILE, tmp_path, config=CURVE)
    quantized = tmp_path / "tiny-minimax-h3-curve-int8_convrot.safetensors"
    save_file(int8_tensorwise(load_file(tmp_path / FILE), convrot=True), quantized)
    meant = _read(comfyui_install, quantized, "int8", tmp_path)  # dequantized by ComfyUI's own layers
    save_file({PREFIX + k: v.contiguous() for k, v in meant.items()}, tmp_path / "meant.safetensors")
    (tmp_path / "meant").mkdir()
    theirs, _ = _comfyui_file(python, comfyui, tmp_path / "meant.safetensors", tmp_path / "meant", config=CURVE)
    ours = _pool_call(quantized, x, x["comfy_audio_sigma"], dtype=torch.float32)
    diffs = {name: (ours[name] - theirs[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the unquantized file's call
    misses = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    assert min(misses.values()) > 10 * TOLERANCE, misses


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_curve_form_minimax_h3(comfy):
    _text(comfy)
    models = comfy.work / "models" / "diffusion_models"
    _comfyui_file(comfy.python, comfy.comfy, models / FILE, config=CURVE)
    _shifted(models / FILE, models / SHIFTED)
    stock = _streams(comfy, _template({"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                                             "weight_dtype": "default"}}, seed=1))
    loader = _loader(ulysses_degree=2)
    ours = _streams(comfy, _template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=1))
    diffs = _max_diffs(ours, stock)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model on the file with the table shifted by one row
    other = _streams(comfy, _template({"class_type": "UNETLoader", "inputs": {"unet_name": SHIFTED,
                                                                             "weight_dtype": "default"}}, seed=1))
    assert min(_max_diffs(ours, other)) > 1e-2, _max_diffs(ours, other)
