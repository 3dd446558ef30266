"""The parallel layout a job runs under, the checks that need nothing but the numbers, and `--layout auto`'s flags
(the choice itself, which measures, is choice.py)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace

from ..fields import Flag, Widget, add_flags, declared, from_flags


class LayoutError(ValueError):
    """A layout that cannot work. The message is one line naming the numbers and the fix."""


# Published per-direction bandwidths and typical latencies (bytes/s, seconds).
LINKS = {
    "nvlink": (450e9, 5e-6),  # NVLink 4 (H100 SXM), per GPU
    "pcie4": (25e9, 10e-6),  # PCIe 4.0 ×16, achievable
    "25gbe": (3.1e9, 30e-6),
    "10gbe": (1.25e9, 30e-6),
}


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def parse(cls, spec: str) -> "Link":
        """A named link (nvlink, pcie4, 25gbe, 10gbe) or "GBYTES_PER_S,LATENCY_US"."""
        if spec in LINKS:
            return cls(*LINKS[spec])
        try:
            rate, latency = (float(part) for part in spec.split(","))
        except ValueError:
            raise ValueError(f"--link {spec!r}: give one of {', '.join(LINKS)} or GBYTES_PER_S,LATENCY_US "
                             "(e.g. 1.25,30 for 10 GbE)") from None
        if rate <= 0 or latency < 0:
            raise ValueError(f"--link {spec!r}: the bandwidth must be above 0 and the latency 0 or more")
        return cls(rate * 1e9, latency * 1e-6)


@dataclass(frozen=True)
class AutoLayout:
    """`--layout auto`: the degrees are chosen for each job size from this machine's measured link and compute
    (choice.py); `link` (a Link.parse spec) predicts for another link instead of the measured one."""

    link: str | None = None

    def rank_arguments(self) -> list[str]:
        return ["--layout", "auto", *(["--link", self.link] if self.link else [])]


def _degree(what: str, flag: str, widget_default: int = 1, maximum: int = 256):
    """A degree's declaration: 1 by default, its flag, and its xDiT Pool input."""
    return declared(1, flag=Flag(flag, help=f"{what}."),
                    widget=Widget(f"Degree of {what.lower()}; all degrees multiply to nproc.", default=widget_default,
                                  maximum=maximum))


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallel dimension; their product is the world size.

    The mesh is dp × cfg × pp × sp with sp = ring × ulysses (outermost first), as in xDiT. Each field is declared
    once: the contract E and pool flags, the rank command line, the xDiT Pool node's inputs and the pool's status
    all come from these declarations (fields.py).
    """

    dp_degree: int = _degree("Data parallel: split the batch over replicas", "--dp-degree")
    cfg_degree: int = declared(1, flag=Flag("--cfg-parallel", on=2, help="Run the two guidance branches on two ranks."),
                               widget=Widget("Run the two guidance branches on two ranks (counts as degree 2).",
                                             name="cfg_parallel", default=False, on=2))
    pipefusion_degree: int = _degree("PipeFusion patch pipeline stages", "--pipefusion-degree", maximum=64)
    ring_degree: int = _degree("Ring attention sequence parallel", "--ring-degree")
    ulysses_degree: int = _degree("Ulysses sequence parallel (heads ↔ tokens)", "--ulysses-degree", widget_default=2)
    num_patches: int | None = declared(None, flag=Flag("--num-patches", help="PipeFusion patches (default: pp degree)."),
                                       widget=Widget("PipeFusion patches (0: the PipeFusion degree).", default=0,
                                                     minimum=0, maximum=64, unset=0))
    warmup_steps: int = declared(1, flag=Flag("--warmup-steps", help="PipeFusion synchronous warm-up steps."),
                                 widget=Widget("PipeFusion synchronous warm-up steps.", default=1, minimum=0,
                                               maximum=100))
    # PipeFusion's patches flow across steps where the call allows (pipefusion.py); False: every step ends on every stage
    patch_flow: bool = declared(True, flag=Flag("--no-patch-flow", on=False, help=(
        "PipeFusion: end every step on every stage instead of letting the patches flow across steps.")), widget=Widget(
        "PipeFusion: the patches flow across steps where the call allows; off: every step ends on every stage."))
    # FSDP2: each rank keeps 1/world of every transformer block (weight_sharding.py)
    shard_weights: bool = declared(False, flag=Flag("--shard-weights", on=True, help=(
        "Split every transformer block's weights over the ranks (FSDP2); not with PipeFusion.")), widget=Widget(
        "Split every transformer block's weights over the ranks (FSDP2), for models larger than one GPU; not with "
        "PipeFusion or fp8."))
    # with shard_weights: the shards wait in CPU memory, on the GPU only while their block runs
    offload: bool = declared(False, flag=Flag("--offload", on=True, help=(
        "With --shard-weights: keep the shards in CPU memory, on the GPU only while their block runs.")), widget=Widget(
        "With shard_weights: keep the shards in CPU memory, on the GPU only while their block runs, for models that do "
        "not fit even sharded."))
    # torch.compile of every transformer block's forward (compile.py)
    compile: bool = declared(False, flag=Flag("--compile", on=True, help=(
        "torch.compile every transformer block (the first job of each size pays the compilation).")), widget=Widget(
        "torch.compile every transformer block: faster steps once the first job of each size has paid the compilation."))
    # more ranks than CUDA cards: the cards shared round-robin, the world over gloo (distributed/devices.py)
    share_gpus: bool = declared(False, flag=Flag("--share-gpus", on=True, help=(
        "allow more ranks than CUDA cards: they share the cards over gloo (slow; Ulysses, CFG, dp)")), widget=Widget(
        "Allow more ranks than CUDA cards: they share the cards over gloo (slow; Ulysses, CFG and dp only)."))
    # fp8 weights multiplied in fp8 on cards that can; None: where ComfyUI would (loading/checkpoints/fp8_matmul.py)
    fp8_matmul: bool | None = declared(None, flag=Flag("--fp8-matmul", help=(
        "multiply fp8 weights in fp8 (torch._scaled_mm) on cards with fp8 tensor cores (compute capability 8.9+); "
        "default: for the files ComfyUI runs that way (its scaled fp8)")), widget=Widget(
        "fp8 weights multiplied in fp8 on cards with fp8 tensor cores (8.9+). auto: for the files ComfyUI runs that way.",
        choices={"auto": None, "on": True, "off": False}))
    # Ulysses heads in groups, the next group's all-to-all in flight while attention runs on this one (usp.py);
    # None: the count that pays on the link, which `--layout auto` prices (overlap.py); off where nothing prices it
    ulysses_overlap_groups: int | None = declared(None, flag=Flag("--ulysses-overlap-groups", metavar="GROUPS", help=(
        "Ulysses: split each rank's heads into this many groups (at most one per head) and send the next group's "
        "all-to-all while attention runs on this one (1: off; default: with --layout auto the count that pays on the "
        "link, otherwise off; not with PipeFusion)")),
        widget=Widget("Ulysses: heads in this many groups, the next group's all-to-all hidden behind this group's "
                      "attention (0: auto, the count that pays on the link under layout auto, otherwise off; 1: off).",
                      default=0, minimum=0, maximum=64, unset=0))
    # derived by for_world (--shard-weights alone on N ranks): the dp ranks split a batch only where it divides
    dp_when_divisible: bool = declared(False)

    @property
    def sp_degree(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def patches(self) -> int:
        """PipeFusion patches per step after warm-up."""
        return self.num_patches or self.pipefusion_degree

    @property
    def world_size(self) -> int:
        return self.dp_degree * self.cfg_degree * self.pipefusion_degree * self.sp_degree

    def for_world(self, world_size: int) -> "ParallelConfig":
        """The layout the ranks run: as given, except `--shard-weights` with every degree 1 on several ranks, where the
        world holds one copy of the weights (FSDP2 over every rank) and its ranks are data-parallel replicas that split
        a batch where it divides and otherwise each compute the whole step on the gathered blocks."""
        if self.shard_weights and self.world_size == 1 and world_size > 1:
            return replace(self, dp_degree=world_size, dp_when_divisible=True)
        return self

    def batch_split(self, batch: int) -> list[int] | None:
        """Samples per data-parallel rank (in rank order, uneven where the batch does not divide), or None where every
        dp rank runs the whole batch (no data parallelism, or `dp_when_divisible` and a batch that does not divide)."""
        n = self.dp_degree
        if n == 1 or (self.dp_when_divisible and batch % n):
            return None
        q, r = divmod(batch, n)
        return [q + 1] * r + [q] * (n - r)

    def describe(self) -> str:
        parts = [
            f"{name}={value}"
            for name, value in (
                ("dp", self.dp_degree),
                ("cfg", self.cfg_degree),
                ("pipefusion", self.pipefusion_degree),
                ("ring", self.ring_degree),
                ("ulysses", self.ulysses_degree),
            )
            if value > 1
        ]
        if self.dp_when_divisible:
            parts = [f"dp={self.dp_degree} where the batch divides"]
        layout = " × ".join(parts) or "single rank"
        if self.shard_weights and self.world_size == 1:  # every degree 1: see for_world
            layout = "dp over every rank where the batch divides"
        if self.shard_weights:
            layout += ", sharded weights offloaded to CPU" if self.offload else ", sharded weights"
        return f"{layout}, compiled" if self.compile else layout

    def check(self, world_size: int, ranks_flag: str = "--nproc-per-node") -> None:
        """Raise LayoutError unless these degrees can run on `world_size` ranks (`ranks_flag`: how the caller's entry
        point spells the number of ranks, a flag or a node input, for the fix the message suggests). The xDiT Pool
        node and its panel ask this too (nodes/routes.py): one check, one message, wherever a layout is set."""
        for name, value in asdict(self).items():
            if name.endswith("_degree") and (not isinstance(value, int) or value < 1):
                raise LayoutError(f"--{name.replace('_', '-')} is {value}; every degree must be an integer >= 1.")
        if self.cfg_degree > 2:
            raise LayoutError(
                f"--cfg-degree is {self.cfg_degree}; classifier-free guidance has two branches, so use 1 or 2."
            )
        if self.pipefusion_degree > 1 and self.warmup_steps < 1:
            raise LayoutError(
                f"--warmup-steps is {self.warmup_steps}; PipeFusion needs at least 1 synchronous step to fill its "
                "stale K/V, so use --warmup-steps 1 or more."
            )
        if self.shard_weights and self.pipefusion_degree > 1:
            raise LayoutError(
                f"--shard-weights with --pipefusion-degree {self.pipefusion_degree}: PipeFusion stages already hold "
                "only their own blocks and run different blocks at once, so drop one of the two."
            )
        if self.share_gpus and (self.ring_degree > 1 or self.pipefusion_degree > 1 or self.shard_weights):
            raise LayoutError("--share-gpus runs the world over gloo, which sends no CUDA tensor point to point and has "
                              "no FSDP collectives on them: use Ulysses, CFG or data parallel with it (no --ring-degree, "
                              "--pipefusion-degree or --shard-weights)")
        if self.offload and not self.shard_weights:
            raise LayoutError("--offload moves the sharded blocks' weights to CPU memory between uses: add --shard-weights.")
        if self.ulysses_overlap_groups is not None and self.ulysses_overlap_groups < 1:
            raise LayoutError(f"--ulysses-overlap-groups is {self.ulysses_overlap_groups}; use 1 (off) or more (default: "
                              "priced by --layout auto).")
        if self.num_patches is not None and self.num_patches < 1:
            raise LayoutError(f"--num-patches is {self.num_patches}; use 1 or more (default: the pipefusion degree).")
        if self.world_size != world_size and self.for_world(world_size).world_size != world_size:
            others = self.world_size // self.ulysses_degree
            ulysses = "--ulysses-degree" if ranks_flag.startswith("--") else "ulysses_degree"
            fix = f"set {ulysses} to {world_size // others}, or " if world_size % others == 0 else ""
            raise LayoutError(
                f"dp {self.dp_degree} × cfg {self.cfg_degree} × pipefusion {self.pipefusion_degree} × "
                f"ring {self.ring_degree} × ulysses {self.ulysses_degree} = {self.world_size}, but there are "
                f"{world_size} ranks ({ranks_flag} is {world_size}); {fix}change the degrees (or {ranks_flag}) so the "
                f"product is {world_size}"
                + (", or give them all as 1 to shard the weights over every rank." if self.shard_weights else ".")
            )


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout flags shared by the one-shot runner and the pool CLI (contracts E and P)."""
    group = parser.add_argument_group("parallel layout (degrees multiply to the number of ranks)")
    add_flags(group, ParallelConfig)
    group.add_argument("--layout", choices=["auto"], default=None,
                       help="auto: measure the link and the compute, predict each layout's step time, run the fastest "
                            "(instead of the degrees; a pool chooses again for each new job size)")
    group.add_argument("--link", default=None, metavar="LINK",
                       help="with --layout auto: predict for this link instead of the measured one: nvlink, pcie4, "
                            "25gbe, 10gbe or GBYTES_PER_S,LATENCY_US")


def auto_layout_from_args(args: argparse.Namespace) -> AutoLayout | None:
    """`--layout auto [--link LINK]`, checked: None when the degrees are given."""
    if args.layout != "auto":
        if args.link:
            raise LayoutError("--link is for --layout auto")
        return None
    degrees = ("ulysses_degree", "ring_degree", "pipefusion_degree", "dp_degree")
    if args.share_gpus:
        raise LayoutError("--layout auto measures one card per rank: drop --share-gpus")
    if any(getattr(args, d) != 1 for d in degrees) or args.cfg_parallel or args.num_patches:
        raise LayoutError("--layout auto chooses the degrees itself: drop --ulysses/--ring/--pipefusion/--dp-degree, "
                          "--cfg-parallel and --num-patches")
    if args.link:
        Link.parse(args.link)
    return AutoLayout(args.link)


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return from_flags(ParallelConfig, args)
