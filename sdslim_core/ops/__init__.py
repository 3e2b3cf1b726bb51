"""Pure tensor math: the fold, LoRA deltas (in full and in slim space), rank policy, quantisation, sampling."""
