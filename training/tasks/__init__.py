"""Tasks of the trainer: what a batch is, how the model is built and what its loss is (GPT-2, BERT)."""
