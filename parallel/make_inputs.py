"""Write contract E's inputs (IN.safetensors) from a prompt, with the pipeline's own text encoders.

    python -m parallel.make_inputs --model DIR --prompt "a red fox" [--negative-prompt ""] [--seed 0] \
        --height H --width W --out IN.safetensors

The tensors are what the diffusers pipeline computes inside `__call__(prompt=…, generator=seed)`
(prompt_inputs.py); this runs in one process, on a one-rank world, as rank 0 of a pool does.
"""

from __future__ import annotations

import os
import socket
import sys

from .loading import builtin_models
from .cli.arguments import ArgumentParser


def parse_args(argv=None):
    parser = ArgumentParser(prog="python -m parallel.make_inputs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"pipeline folder (with its text encoders) or one of {', '.join(builtin_models.NAMES)}")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", action="append", default=[], metavar="PICTURE",
                        help="a reference picture for an edit model, encoded with both prompts (Qwen-Image-Edit, "
                             "Qwen-Image 2.1; repeat for Edit Plus's or 2.1's several, one size)")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--out", required=True, help="the IN.safetensors to write")
    return parser.parse_args(argv)


def _one_rank_world() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(name, value)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        builtin_models.check_model(args.model)
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            raise ValueError(f"--out {args.out}: the folder {folder} does not exist; create it first")
        from safetensors.torch import save_file

        from .layout.config import ParallelConfig
        from .distributed import destroy_distributed_environment, initialize_model_parallel
        from .loading.pipelines import load_pipeline
        from .model_executor import wrap_pipeline
        from .model_executor.prompt_inputs import prompt_inputs, reference_pictures

        image = reference_pictures(args.image) if args.image else None
        _one_rank_world()
        initialize_model_parallel(ParallelConfig())
        try:
            pipeline = wrap_pipeline(load_pipeline(builtin_models.resolve_model(args.model), text_encoders=True))
            tensors = prompt_inputs(pipeline, args.prompt, args.negative_prompt, args.seed, args.height, args.width, image)
        finally:
            destroy_distributed_environment()
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    save_file(tensors, args.out)
    shapes = ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in sorted(tensors.items()))
    print(f"wrote {args.out}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
