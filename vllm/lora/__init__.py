"""Multi-LoRA serving: adapter requests, PEFT adapter loading per stage and TP rank, and the
batched low-rank update applied to the linear layers of the model."""
