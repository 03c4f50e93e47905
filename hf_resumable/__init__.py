"""hf_resumable: crash-safe, bit-exact resumable training for the Hugging Face stack."""

__version__ = "0.1.0"
