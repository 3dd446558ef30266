"""`--layout auto`: measure this machine's link and compute, predict every valid layout's step time, take the fastest.

The model (prediction.py) prices what each method sends and computes per step, less what overlapping hides
(overlap.py); it is calibrated here by one step of the job itself, run as diffusers runs it on every rank at once
(probes.py): its blocks' time against the synthetic block's (their ratio scales every synthetic time), and the time
outside the blocks (embedders, norms, the scheduler) per sample, which a rank pays for its samples on its share of
the tokens. Each Ulysses layout comes out with the head groups that pay on the link (`--ulysses-overlap-groups`,
unless given), and the ranks run with those. `--link` replaces the measured link with a named or given one (to plan
for another machine, or to see the choice move as the link slows).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .config import LayoutError, Link, ParallelConfig
from .prediction import Job, Prediction, block_shapes, candidate_layouts, predict
from .probes import measure_blocks, measure_links, measure_serial_step, slowest


def choose(world: int, base: ParallelConfig, job: Job, valid, device, dtype, link: Link | None = None,
           serial_step: tuple[float, float] | None = None, attention_kernel: str | None = None,
           ) -> tuple[ParallelConfig, list[Prediction], tuple[Link, Link]]:
    """The fastest predicted layout among `candidate_layouts` that `valid(config)` accepts, every prediction
    (fastest first) and the links used. `serial_step`: (seconds in the blocks, seconds outside them) of one real
    step on one rank, which calibrates the synthetic blocks. Collective: every rank calls it alike."""
    layouts = [c for c in candidate_layouts(world, base) if valid(c)]
    if not layouts:
        raise LayoutError(f"--layout auto found no layout of {world} ranks that this model and job can run")
    i, t = job.image_tokens, job.text_tokens
    serial = (i + t, i + t, i + t, job.heads, 1)
    shapes = list(dict.fromkeys([serial, *(s for c in layouts for s in block_shapes(c, job))]))
    measured = measure_blocks(shapes, job, device, dtype, attention_kernel)
    seconds, (collective, p2p) = slowest([measured[s] for s in shapes] + list(serial_step or (0.0, 0.0)),
                                         measure_links(device), device)
    blocks = dict(zip(shapes, seconds))
    if serial_step is not None:
        in_blocks, outside = seconds[-2:]
        real = in_blocks / (job.batch * job.branches * job.blocks)  # one block on one sample
        job = replace(job, block_scale=real / blocks[serial], outside_s=outside / (job.batch * job.branches))
    if link is not None:
        collective = p2p = link
    predictions = sorted((predict(c, job, blocks, collective, p2p) for c in layouts),
                         key=lambda p: (p.step_s, p.bytes_per_step))
    return predictions[0].config, predictions, (collective, p2p)


def attention_module(transformer: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The transformer's first attention layer (its heads and widths stand for every layer's) and its head count,
    which Krea 2's layers name `num_heads`."""
    return next((m, heads) for m in transformer.modules() if isinstance(getattr(m, "to_q", None), torch.nn.Linear)
                and (heads := getattr(m, "heads", None) or getattr(m, "num_heads", None)))


def auto_layout(pipeline, base: ParallelConfig, call: dict, world: int, link: Link | None = None,
                attention_kernel: str | None = None):
    """(the chosen layout, every prediction fastest first, the links used) for `call` on `pipeline`, the pipeline
    left unwrapped and no mesh built. Collective: every rank calls it alike."""
    from ..model_executor.layout_scope import under_layout
    from ..loading.weight_sharding import transformer_blocks

    provisional = ParallelConfig(dp_degree=world)
    transformer = pipeline.transformer  # diffusers' own, before the provisional wrapping
    with under_layout(pipeline, provisional) as wrapped:
        # the call as the pipeline takes it (Qwen-Image 2.1's takes no guidance_scale), checked for any layout
        kwargs, batch, image_tokens = wrapped.prepare(call, check_layout=False)
        plan = wrapped.module.transformer.plan

        def valid(config: ParallelConfig) -> bool:
            if config.pipefusion_degree > 1 and plan.pipefusion is None:
                return False
            try:
                config.check(world)
                wrapped.parallel_config = config
                wrapped.check_layout(kwargs, batch)
                return True
            except LayoutError:
                return False
            finally:
                wrapped.parallel_config = provisional

        attention, heads = attention_module(transformer)
        text = kwargs.get("prompt_embeds")
        config = transformer.config
        job = Job(
            image_tokens=image_tokens,
            text_tokens=text.shape[1] if isinstance(text, torch.Tensor) else 0,
            text_splits=plan.text_input is None or any(s.text for specs in plan.inputs.values() for s in specs.values()),
            heads=heads, head_dim=attention.to_q.out_features // heads,
            hidden=attention.to_q.in_features, blocks=len(transformer_blocks(transformer)),
            out_channels=config.get("out_channels") or config.get("in_channels") or attention.to_q.in_features,
            element_bytes=transformer.dtype.itemsize, batch=batch, steps=kwargs["num_inference_steps"],
            branches=2 if wrapped.uses_cfg(kwargs) else 1,
            flows=wrapped.patches_flow(kwargs, replace(base, pipefusion_degree=2)),
        )
        serial = measure_serial_step(wrapped, kwargs, transformer_blocks(transformer))
        return choose(world, base, job, valid, transformer.device, transformer.dtype, link, serial, attention_kernel)


def describe(predictions: list[Prediction], links: tuple[Link, Link], measured: bool) -> list[str]:
    """The prediction table, one line per layout, fastest first, after the links it used."""
    collective, p2p = links
    source = "measured" if measured else "given"
    lines = [f"links ({source}): all-to-all {collective.bytes_per_s / 1e9:.3g} GB/s + {collective.latency_s * 1e6:.3g} us, "
             f"exchange {p2p.bytes_per_s / 1e9:.3g} GB/s + {p2p.latency_s * 1e6:.3g} us"]
    for p in predictions:
        groups = p.config.ulysses_overlap_groups or 1
        lines.append(f"{p.step_s * 1e3:10.2f} ms/step  (compute {p.compute_s * 1e3:.2f}, traffic {p.comm_s * 1e3:.2f}, "
                     f"hidden {p.hidden_s * 1e3:.2f}, {p.bytes_per_step / 2**20:.2f} MiB)  {p.config.describe()}"
                     + (f", {groups} head groups" if groups > 1 else ""))
    return lines
