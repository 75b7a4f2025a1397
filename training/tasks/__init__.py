"""Tasks of the trainer (``protocol.Task``): what a batch is, how the model is built and what its loss is
(GPT-2 and BERT pretraining, RACE fine-tuning)."""
