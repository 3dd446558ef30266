"""Loading models as users have them: diffusers pipeline folders and single files (pipelines.py, checkpoints/),
the built-in tiny models, LoRAs, vision-language processors without torchvision, and weight sharding at load."""
