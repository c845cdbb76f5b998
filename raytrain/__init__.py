"""raytrain: elastic fine-tuning of Hugging Face causal LMs on Ray (FSDP2, ZeRO-3, DDP)."""

__version__ = "0.1.0"
