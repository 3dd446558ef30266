"""Pipeline wrappers: one per diffusers pipeline class; `xFuserPipelineBaseWrapper.wrap` picks it."""

from . import pipeline_flux, pipeline_pixart_alpha, pipeline_pixart_sigma, pipeline_stable_diffusion_3, pipeline_wan
from .base_pipeline import xFuserPipelineBaseWrapper

__all__ = [
    "pipeline_flux",
    "pipeline_pixart_alpha",
    "pipeline_pixart_sigma",
    "pipeline_stable_diffusion_3",
    "pipeline_wan",
    "xFuserPipelineBaseWrapper",
]
