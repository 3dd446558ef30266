"""One typed structure per message kind of the client protocol, each declaring its fields and its tensors.

A client message (submit, encode, evaluate, decode, cancel, status, stop) is checked once, where it arrives,
against its declaration (parallel/fields.py) and travels on as that typed value: rank 0's server validates it,
queues it, and broadcasts the same value to the other ranks as their work item (rank/work.py), which read it
once more on their side of that hop and never again. The pool's replies are typed where the pool builds
them; `PoolStatus` is the status a client reads. Adding a field is one line here.

Tensor names a kind accepts come from the engine's families, which only the pool needs: `tensor_names()` is
asked when a client message is decoded, never by a client that only reads replies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from collections.abc import Mapping
from typing import Any, ClassVar

from ..engine import engine, fields, request

declared, to_plain = fields.declared, fields.to_plain
LoraSpec, SampleRequest = request.LoraSpec, request.SampleRequest
ModelCallCache = engine("cache_settings").ModelCallCache

MAX_PROMPT_CHARS = 20_000
MAX_LORAS = 16
CONDITIONING_KEY = re.compile(r"[0-9a-f]{32}")  # key_of's digest


@cache
def _engine_tensors() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(a job's tensor inputs, a model call's) over every registered pipeline: the families' own lists."""
    from ..engine import tensor_inputs

    pipeline, model_call = tensor_inputs()
    return (*pipeline, "init_latents"), model_call


def job_inputs() -> tuple[str, ...]:
    """A submit's tensors: every pipeline's inputs, and init_latents (img2img's starting point)."""
    return _engine_tensors()[0]


def model_call_tensors() -> tuple[str, ...]:
    return _engine_tensors()[1]


def key_of(tensor) -> str:
    """A conditioning tensor's key: the hash of its dtype, shape and bytes (a model call names it by this)."""
    import hashlib

    import torch

    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}|{list(tensor.shape)}|".encode())
    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _prompt(name: str, value: str) -> None:
    if len(value) > MAX_PROMPT_CHARS:
        raise ValueError(f"{name} is {len(value)} characters; the limit is {MAX_PROMPT_CHARS}")


def _loras(name: str, loras: tuple) -> None:
    if len(loras) > MAX_LORAS:
        raise ValueError(f"{len(loras)} LoRAs in one job; the limit is {MAX_LORAS}")


def _conditioning(name: str, keys: dict) -> None:
    if any(tensor not in model_call_tensors() or not isinstance(key, str) or not CONDITIONING_KEY.fullmatch(key)
           for tensor, key in keys.items()):
        raise ValueError("evaluate's conditioning maps model-call tensor names to 32-hex-digit keys (conditioning.key_of)")


class Kind:
    """A typed message: `TYPE` on the wire, its declared fields as params, `tensor_names()` it may carry.

    A subclass names its kind, `class Stop(Kind, kind="stop")`, and is made a frozen dataclass of its declared fields
    (as msgspec's Struct or pydantic's models are), so a message kind is its name and its fields, nothing else."""

    TYPE: ClassVar[str]

    def __init_subclass__(cls, kind: str | None = None, **options):
        super().__init_subclass__(**options)
        if kind is not None:
            cls.TYPE = kind
        dataclass(frozen=True)(cls)

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return ()

    def validate(self) -> None:
        """Rules across fields, after each field passed its own."""

    def params(self) -> dict[str, Any]:
        return to_plain(self)


# -- client → pool -------------------------------------------------------------------------------------
class Submit(SampleRequest, Kind, kind="submit"):
    """A sampling job: the request (parallel/request.py), and what the pool adds to it."""

    scheduler: str = declared("default")
    preview: bool = declared(True)
    model_latents: bool = declared(False)  # latents in and out as the pipeline's loop keeps them (xDiT Sampler's conversion)
    loras: tuple[LoraSpec, ...] = declared((), check=_loras)

    tensor_names = staticmethod(job_inputs)


class Encode(Kind, kind="encode"):
    """The pool pipeline's own text encoding; with a seed (and height, width), a whole job's inputs, negative prompt
    and initial noise included. An `image` ([N, 3, H, W] in [0, 1]) is encoded with the prompts where the text
    encoder sees images (edit models)."""

    prompt: str = declared(check=_prompt)
    negative_prompt: str = declared("", check=_prompt)
    seed: int | None = declared(None)
    height: int | None = declared(None)
    width: int | None = declared(None)

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return ("image",)

    def validate(self) -> None:
        if self.seed is not None and (self.height is None or self.width is None):
            raise ValueError("encode with a seed needs height and width (the size of the initial noise)")


class Evaluate(Kind, kind="evaluate"):
    """One model evaluation (ComfyUI's samplers through xDiT Model): latents, sigma and the conditioning, each
    conditioning tensor named by its key (conditioning.py) and sent only when the pool may not hold it."""

    conditioning: dict[str, Any] = declared(factory=dict, check=_conditioning)  # tensor name → key: each checked there
    loras: tuple[LoraSpec, ...] = declared((), check=_loras)
    expert: str = declared("")  # the pipeline's transformer to call by attribute name ("": `transformer`; e.g. "transformer_2")
    cache: ModelCallCache = declared(ModelCallCache())  # the step cache of the sampling run (xDiT Cache (model))

    tensor_names = staticmethod(model_call_tensors)


class Decode(Kind, kind="decode"):
    """LATENT tensors decoded with the pool's VAE, tiles over the ranks (parallel/model_executor/vae_decode.py); tile in latent
    pixels, 0: about one tile per rank. `audio`: audio latents decoded with the pool's audio VAE and vocoder (LTX-2;
    MiniMax-H3's audio VAE, whose decoder is its vocoder),
    beside the video's latents or alone. model_latents: both are in the sampling loop's space (a job's results with
    `model_latents`; LTX-2's normalised latents, as ComfyUI keeps them), which the pipeline turns into its VAEs' first."""

    tile: int = declared(0)
    model_latents: bool = declared(False)

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return ("latents", "audio")


class Cancel(Kind, kind="cancel"):
    """Cancel the job named by the message's job id, queued or running."""



class StatusQuery(Kind, kind="status"):
    """With `job`: also that job's state (queued, running, unknown)."""

    job: str | None = declared(None)


class Stop(Kind, kind="stop"):
    """Stop the pool: waiting jobs are refused, the running one cancelled."""



# -- pool → client -------------------------------------------------------------------------------------
class Accepted(Kind, kind="accepted"):
    """The job is queued at this position."""

    position: int = declared()


class Step(Kind, kind="step"):
    """A sampling step (or a decoded tile) done; with a `preview` tensor where the job asked for previews."""

    index: int = declared()
    total: int = declared()
    elapsed: float = declared()


class Result(Kind, kind="result"):
    """A job's tensors, with what it reports beside them: its step cache's full and cached model calls (a model
    call's: those of its sampling run so far), or a
    decode's tiles, each rank's share and its audio's samples a second (0: no audio)."""

    cache: dict[str, Any] | None = declared(None)
    tiles: int = declared(0)
    ranks: tuple[dict[str, Any], ...] = declared(())
    sample_rate: int = declared(0)


class Error(Kind, kind="error"):
    """rank: the rank whose error it is (-1: the supervisor); missing: a model call named conditioning the pool
    does not hold (the client sends it again); mistake: the job was refused at submit as it cannot run as asked
    (its inputs, the layout, the pool's limits), not failed while it ran (the CLI exits 2, not 1)."""

    message: str = declared()
    rank: int = declared()
    missing: bool = declared(False)
    mistake: bool = declared(False)


class Cancelled(Kind, kind="cancelled"):
    """The job was cancelled at this step."""

    step: int = declared(0)


class Stopping(Kind, kind="stopping"):
    """The pool is stopping (the answer to Stop)."""



class PoolStatus(Kind, Mapping, kind="status"):
    """What `status` answers, from rank 0 (a loaded pool) or the supervisor's stand-in (starting, restarting,
    waiting for nodes): the supervisor knows only the fields up to `nodes`. Nodes, the panel and the CLI read it
    as this structure (`PoolClient.status`): by attribute, or as a read-only mapping of its fields, named as the
    JSON of `status --json` names them. On the wire it is a map with every field."""

    state: str = declared()  # idle | busy | starting | restarting | waiting for nodes | error
    world_size: int = declared(0)
    ranks_alive: int = declared(0)
    jobs_done: int = declared(0)
    restarts: int = declared(0)
    model: str = declared("")
    parallel: dict[str, Any] = declared(factory=dict)  # the layout's fields and its description
    nodes: tuple[dict[str, Any], ...] = declared(())  # per machine: node, host, ranks, pids, alive
    error: str | None = declared(None)
    restart_reason: str | None = declared(None)
    job_state: str | None = declared(None)  # a status asked about a job: queued | running | unknown
    model_calls: int = declared(0)
    step_caches: dict[str, str] = declared(factory=dict)  # cache method → why diffusers has no hook for it here ("": has)
    last_cache: dict[str, Any] | None = declared(None)
    vae: str | None = declared(None)
    pipeline: str | None = declared(None)  # the diffusers pipeline class, once loaded
    inputs: dict[str, int] = declared(factory=dict)  # tensor input → width (conditioning checks)
    model_class: str = declared("")  # the comfy.supported_models class of an xDiT Model
    latent_scale: int = declared(0)  # pixels per latent pixel of the pool's VAE
    text_encoders: bool = declared(False)
    dtype: str = declared("as saved")
    storage: dict[str, int] = declared(factory=dict)  # transformer bytes per storage dtype
    fp8_matmul: int = declared(0)  # fp8 layers multiplying in fp8 (--fp8-matmul)
    p2p: str = declared("n/a")  # how this machine's cards reach each other (parallel/distributed/devices.py)
    cards: tuple[dict[str, Any], ...] = declared(())  # per local rank: its card
    mixed_cards: bool = declared(False)
    loads: dict[str, int] = declared(factory=dict)
    loras: tuple[dict[str, Any], ...] = declared(())
    mesh: tuple[dict[str, Any], ...] = declared(())  # each rank's coordinates in the dp × cfg × pp × sp mesh
    layout_auto: dict[str, Any] | None = declared(None)
    memory: tuple[dict[str, Any], ...] = declared(())
    queue: int = declared(0)
    step: int = declared(0)
    compile: dict[str, Any] | None = declared(None)
    pids: tuple[int, ...] = declared(())

    def params(self) -> dict[str, Any]:
        """Every field, defaults included: a status is read by scripts (`status --json`) that expect each key."""
        return to_plain(self, defaults=True)

    def __getitem__(self, name: str) -> Any:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


CLIENT_KINDS: dict[str, type[Kind]] = {kind.TYPE: kind for kind in (Submit, Encode, Evaluate, Decode, Cancel,
                                                                    StatusQuery, Stop)}
SERVER_KINDS: dict[str, type[Kind]] = {kind.TYPE: kind for kind in (Accepted, Step, Result, Error, Cancelled,
                                                                    PoolStatus, Stopping)}
