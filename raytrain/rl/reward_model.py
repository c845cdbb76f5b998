"""A reward model as a GRPO reward (`training.grpo.rewards: [{model: ...}]`): what `raytrain run`
exports for `objective: reward` (a full `...ForSequenceClassification` folder, or a LoRA adapter
over the base model it names), scoring each prompt + completion as TRL's GRPOTrainer scores with a
reward model: the texts joined (a conversation rendered by the reward tokenizer's chat template),
tokenized with right padding and no special tokens, and the head's one logit at the last real token.

Loaded from safetensors only, with trust_remote_code off: nothing read from storage runs code."""

from __future__ import annotations

from pathlib import Path

import torch

from raytrain.job.grpo import reward_model_base


class RewardModel:
    def __init__(self, path: str, device: torch.device | str, dtype: torch.dtype | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = dtype or torch.float32

        adapter = Path(path, "adapter_config.json").is_file()
        base = reward_model_base(path)
        tok_dir = path if any(Path(path, f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else base
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
        if self.tokenizer.pad_token_id is None:  # TRL's rule: the head reads the last token that is not padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            base,
            num_labels=1,
            pad_token_id=self.tokenizer.pad_token_id,
            dtype=dtype,
            use_safetensors=True,
            trust_remote_code=False,
        )
        if adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, path, use_safetensors=True).merge_and_unload()
        self.model = model.to(device).eval()
        self.device = device

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list) -> list[float]:
        if isinstance(prompts[0], list):  # conversational: TRL renders prompt + completion messages
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        return self.model(**inputs).logits[:, 0].float().tolist()  # host: the rewards, for the advantages
