from diffusers import PixArtSigmaPipeline

from ..register import xFuserPipelineWrapperRegister
from .pipeline_pixart_alpha import xFuserPixArtAlphaPipeline


@xFuserPipelineWrapperRegister.register(PixArtSigmaPipeline)
class xFuserPixArtSigmaPipeline(xFuserPixArtAlphaPipeline):
    """Same transformer class and call as PixArt-α."""
