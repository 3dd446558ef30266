from diffusers import StableDiffusion3Pipeline

from ..register import xFuserPipelineWrapperRegister
from .base_pipeline import xFuserPipelineBaseWrapper


@xFuserPipelineWrapperRegister.register(StableDiffusion3Pipeline)
class xFuserStableDiffusion3Pipeline(xFuserPipelineBaseWrapper):
    pass
