"""Online reinforcement learning on the training workers: GRPO (TRL's GRPOTrainer's loss and
metrics) with rollouts sampled by the workers' own model.

spec      the `training.grpo` section and the rules that tie it to the rest of the job (pure)
rewards   built-in rewards and a user's `module:function` (TRL's signature); pure Python
losses    TRL's advantages, per-token losses, their reduction and the vLLM mismatch correction (torch)
engine    `engine: vllm`: a vLLM engine beside each worker, synced every step (torch)
sampling  the rollout: a counter-based sampler, so completions are a function of (seed, step,
          prompt, generation, policy), whatever the worker count or micro-batch
(the GRPO objective the loop trains is objectives/grpo.py, beside the others)

Importing this package loads neither torch nor Ray (`raytrain validate` reads `spec`; losses, engine
and sampling import torch themselves).
"""
