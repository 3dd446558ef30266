"""Loader cost: a model call of Load Diffusion Model (xDiT Pool)'s MODEL next to ComfyUI's own model of the same file.

    python -m bench.loader_call [--tiny] [--runs 20] [--comfyui DIR --python PATH]

What a workflow pays per model evaluation for swapping UNETLoader for the loader: both MODELs are built by
ComfyUI's own code in one ComfyUI process (its UNETLoader path, comfy.sd.load_diffusion_model, and the loader's
MODEL: ComfyUI's model class with the pool's stand-in), and each is called as ComfyUI's samplers call it
(`BaseModel.apply_model`, cond and uncond batched), alternating call by call, one thread on each side (the pool:
one rank, one thread, the same file). The file is a FLUX.1 [dev] in BFL's layout at ComfyUI's head size (128):
`medium` 512 wide, 4 + 4 blocks, 512² (1024 image tokens, 128 text tokens); `--tiny` 256 wide, 1 + 1 blocks, 64².
The ComfyUI is the test bed's (tests/testbed.py) unless --comfyui / --python name another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SIZES = {  # FluxTransformer2DModel at ComfyUI's head size; image side in pixels, text tokens
    "medium": (dict(num_layers=4, num_single_layers=4, num_attention_heads=4, joint_attention_dim=256,
                    pooled_projection_dim=256), 512, 128),
    "tiny": (dict(num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=32,
                  pooled_projection_dim=16), 64, 16),
}


def _file(size: str, folder: Path) -> Path:
    """The FLUX.1 [dev] file of that size in BFL's layout (tests/original_layouts.py writes it)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from original_layouts import original_layout

    config, _, _ = SIZES[size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, attention_head_dim=128, guidance_embeds=True,
                                             axes_dims_rope=(16, 56, 56), **config).eval()
    path = folder / f"bench-flux1-dev-{size}.safetensors"
    save_file({k: v.contiguous() for k, v in original_layout("flux", transformer).items()}, path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loader_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny file instead of the medium one")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI folder (default: the test bed's)")
    parser.add_argument("--python", type=Path, help="its python (with --comfyui)")
    parser.add_argument("--json", type=Path, default=None, help="default: bench/out/loader_call_<size>.json")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "medium"
    comfy, python = (args.comfyui, args.python) if args.comfyui else _testbed()
    from workers.supervisor.pool import Pool, PoolSpec
    from workers.wire.endpoints import free_endpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = _file(size, Path(tmp))
        pool = Pool(PoolSpec(model=str(path), nproc=1, endpoint=free_endpoint(), threads_per_rank=1)).start()
        try:
            spec = json.dumps({"file": str(path), "endpoint": pool.spec.endpoint, "size": size, "runs": args.runs})
            done = subprocess.run([str(python), "-c", DRIVER, str(ROOT), spec], cwd=comfy, capture_output=True, text=True)
        finally:
            pool.stop()
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    report = json.loads(done.stdout.strip().splitlines()[-1])
    out = args.json or OUT / f"loader_call_{size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    own, ours = (statistics.median(report["runs"][name]) * 1000 for name in ("comfyui", "loader"))
    print(f"| {size} FLUX.1 [dev] file, one model call (cond + uncond) | median ms | spread ms |")
    print("|---|---|---|")
    for name, label in (("comfyui", "ComfyUI's own model (UNETLoader)"), ("loader", "the loader's MODEL (1-rank pool)")):
        times = report["runs"][name]
        print(f"| {label} | {statistics.median(times) * 1000:.1f} | {(max(times) - min(times)) * 1000:.1f} |")
    print(f"\nadded per call: {ours - own:.1f} ms, ratio {ours / own:.2f}; max |diff| between the two: "
          f"{report['max_abs_diff']:.2e}")
    return 0


def _testbed() -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    import testbed

    found = testbed.comfyui()
    if isinstance(found, str):
        raise SystemExit(f"no ComfyUI to compare with: {found} (or give --comfyui and --python)")
    return found


# Runs in ComfyUI's python, in its folder: both MODELs of the file, timed call by call (bench.model.alternating's
# rounds, written out here because this interpreter does not import the bench package's torch-side helpers).
DRIVER = r"""
import json, sys, time, types
root, spec = sys.argv[1], json.loads(sys.argv[2])
sys.argv = ["bench", "--cpu", "--use-pytorch-cross-attention"]
import comfy.options; comfy.options.enable_args_parsing()
import torch
torch.set_num_threads(1)
import comfy.sd
for name, path in (("xdit_pack", root), ("xdit_pack.nodes", root + "/nodes")):  # the pack, without its node registry
    module = types.ModuleType(name); module.__path__ = [path]; sys.modules[name] = module
from xdit_pack.nodes import comfy_files
from xdit_pack.nodes.model_node import comfy_model
from xdit_pack.nodes.pools import POOLS, PoolHandle
from xdit_pack.workers.supervisor import PoolSpec

own = comfy.sd.load_diffusion_model(spec["file"], model_options={"dtype": torch.float32}).model
status = POOLS.client(spec["endpoint"]).wait_until_idle(600)
handle = PoolHandle(PoolSpec(model=spec["file"], nproc=1, endpoint=spec["endpoint"]), spec["endpoint"], status)
loader = comfy_model(handle, comfy_files.read(spec["file"])).model
side, text = {"medium": (512, 128), "tiny": (64, 16)}[spec["size"]]
g = torch.Generator().manual_seed(0)
config = own.model_config.unet_config
x = torch.randn(2, 16, side // 8, side // 8, generator=g)
context = torch.randn(2, text, config["context_in_dim"], generator=g)
y = torch.randn(2, config["vec_in_dim"], generator=g)
sigma = torch.full((2,), 0.75)
call = dict(c_crossattn=context, y=y, guidance=torch.full((2,), 3.5), transformer_options={"sigmas": sigma})
sides = {"comfyui": lambda: own.apply_model(x, sigma, **call), "loader": lambda: loader.apply_model(x, sigma, **call)}
with torch.no_grad():
    first = {name: run() for name, run in sides.items()}
    runs = {name: [] for name in sides}
    for round_ in range(spec["runs"]):
        for name in sides if round_ % 2 == 0 else list(sides)[::-1]:
            start = time.perf_counter(); sides[name](); runs[name].append(time.perf_counter() - start)
print(json.dumps({"size": spec["size"], "runs": runs,
                  "max_abs_diff": (first["loader"] - first["comfyui"]).abs().max().item()}))
"""


if __name__ == "__main__":
    raise SystemExit(main())
