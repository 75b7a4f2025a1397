"""Training data: GPT and BERT datasets over the indexed format, blending, sources and the batch sampler."""
