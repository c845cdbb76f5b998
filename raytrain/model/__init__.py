"""The model: what pre-flight knows of one without torch (facts, hub), and the build a worker runs
(from_pretrained or meta, LoRA, attention, kernels, QLoRA's NF4 base). No torch.distributed here."""
