"""The training state's own rules: a model's state dict (ties, aliases), its Hugging Face weight files, the
optimizer's tensors, and the checks on a loaded state."""
