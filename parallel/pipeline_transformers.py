"""The pipeline attributes that hold a transformer, named once for every layer that walks them: wrapping under the
family's plan, compiling, model calls, `--shard-weights`, fp8 storage, fp8 matmuls and LoRA. Plain names and no
imports, so the loading and model_executor packages both read it without a cycle."""

# Wan 2.2 A14B's low-noise expert `transformer_2`; MiniMax-H3's reference-to-video partition `transformer_ref`
TRANSFORMERS = ("transformer", "transformer_2", "transformer_ref")
# The experts that share one LoRA (its `transformer.` weights) and one single-file layout (Wan 2.2 A14B's file pair);
# a partition (transformer_ref) takes LoRA weights under its own name.
EXPERTS = TRANSFORMERS[:2]
