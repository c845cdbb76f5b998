"""Per-device memory estimate for a job, read from the model's files without torch.

The model's parameters are model/facts.py's (its safetensors headers, or its config.json's
dimensions). The estimate is the usual
back-of-the-envelope one, written out term by term so a user can check it:

    full fine-tune   (weights + grads + AdamW m, v [+ fp32 master]) x N / P
    LoRA             weights x N / P + 16 B x N_lora / P    (adapters are fp32 under peft)
    + gathered layers (fsdp2: the all-gathered block and the prefetched next one; zero3: what
      stage3_max_live_parameters lets it keep gathered between forward and backward; GRPO under
      fsdp2: the whole model, gathered for the step)
    + the vocabulary layers (fsdp2: the root unit, the output layer, gathered whole; a full fine-tune also holds their
      whole gradients, twice, at the backward's end)
    + activations (Korthikanti et al. 2022: 34·b·s·d bytes per layer at 16 bit; +5·a·s²·b eager)
    + logits (b·s·V in the compute dtype, its fp32 copy and that copy's gradient; one chunk's
      under training.chunked_loss)
    + runtime (CUDA context, NCCL buffers) on GPUs

P is the ranks one copy of the model is sharded over (`RunPlan.shard_degree`): every worker
for zero3 and flat fsdp2, a node's workers under HSDP, 1 for ddp. Offload moves terms to host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from raytrain.job import deepspeed_config, masks, nf4_layout, strategies
from raytrain.job.grpo import ENGINE_RUNTIME_CPU_GIB, engine_kv_bytes, reward_model_base, reward_model_bytes
from raytrain.job.implementations import effective_attention
from raytrain.job.plan import RunPlan, frozen_head_apart, rank_tokens, splits_vocabulary
from raytrain.job.spec import JobSpec
from raytrain.model import targets
from raytrain.model.facts import DTYPE_BYTES, ModelFacts, read_facts

GiB = 2**30


# ---------------------------------------------------------------- the estimate
@dataclass
class Term:
    label: str
    formula: str
    bytes: float

    def __str__(self) -> str:
        return (
            f"{self.label} {self.formula} = {size(self.bytes)}" if self.formula else f"{self.label} {size(self.bytes)}"
        )


@dataclass
class Estimate:
    workers: int
    device: list[Term] = field(default_factory=list)
    host: list[Term] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.device)

    def arithmetic(self) -> str:
        text = " + ".join(str(t) for t in self.device) + f" = {size(self.total)}"
        if self.host:
            text += f"; offloaded to host memory per worker: {' + '.join(str(t) for t in self.host)}"
        return text


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.2f} MiB"


def _n(x: float) -> str:
    """A parameter count: 8.03B params."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit} params"
    return f"{int(x)} params"


def compute_bytes(spec: JobSpec) -> int:
    return 2 if RunPlan.of(spec).bf16 else 4


def estimate(spec: JobSpec, facts: ModelFacts, workers: int) -> Estimate:
    t, off = spec.training, spec.training.offload
    facts_of = strategies.of(spec)
    sharded = facts_of.shards
    plan = RunPlan.of(spec)
    P, c, w = plan.shard_degree(workers), compute_bytes(spec), DTYPE_BYTES[spec.model.dtype]
    N, per = facts.n_params, f" / {P}" if P > 1 else ""
    out = Estimate(workers)
    # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together;
    # ZeRO-3 offloads the optimizer (with its fp32 master) and the parameters separately.
    together = facts_of.offload == "together"
    host_opt = off.optimizer or (together and off.params)
    host_params = off.params or (together and off.optimizer)
    if facts_of.sixteen_bit_copy:  # DeepSpeed: 16-bit params and grads with an fp32 master in the optimizer; in
        # fp32 its optimizer still clones the partition (stage3's _create_fp32_partitions): 12 B either way
        p_b, opt_b, opt_label = (2, 12, "AdamW m, v + fp32 master") if c == 2 else (4, 12, "AdamW m, v + fp32 copy")
    else:  # fsdp2 / ddp: trained weights are fp32 masters with fp32 grads and AdamW state (to_fp32_master)
        p_b, opt_b, opt_label = 4, 8, "AdamW m, v"
    n_lora = trainable_params(spec, facts) if t.adapters else 0
    if t.finetune == "full":
        terms = [
            (Term("weights", f"{p_b} B × {_n(N)}{per}", p_b * N / P), host_params),
            (Term("gradients", f"{p_b} B × {_n(N)}{per}", p_b * N / P), host_opt and together),
            (Term(f"optimizer ({opt_label})", f"{opt_b} B × {_n(N)}{per}", opt_b * N / P), host_opt),
        ]
    else:
        base_b = 2 if facts_of.sixteen_bit_copy and c == 2 else w
        frozen = Term("frozen weights", f"{base_b} B × {_n(N)}{per}", base_b * N / P)
        if t.finetune == "qlora":  # the adapted layers' weights in NF4, the rest (embeddings, norms) as loaded
            shapes = quantized_shapes(spec, facts)
            qn, qb = (
                sum(r * k for r, k in shapes.values()),
                sum(nf4_layout.quantized_bytes(r, k) for r, k in shapes.values()),
            )
            frozen = Term(
                "frozen weights (NF4 where adapted)",
                f"({qb / max(qn, 1):.3g} B × {_n(qn)} + {w} B × {_n(N - qn)}){per}",
                (qb + w * (N - qn)) / P,
            )
        terms = [
            (frozen, host_params),
            (Term("adapter (fp32 weights, grads, AdamW)", f"16 B × {_n(n_lora)}{per}", 16 * n_lora / P), host_opt),
        ]
    if spec.reference_copy:  # DPO's frozen reference, sharded like the model
        ref_b = 2 if facts_of.sixteen_bit_copy and c == 2 else w  # frozen: kept as loaded (ZeRO-3: its 16-bit copy)
        terms.append((Term("DPO reference copy (frozen)", f"{ref_b} B × {_n(N)}{per}", ref_b * N / P), host_params))
    for term, on_host in terms:
        (out.host if on_host else out.device).append(term)
    if (
        sharded
        and facts_of.sync_last_micro_batch
        and plan.accumulation_steps(workers) > 1
        and not plan.sync_every_micro_batch
    ):
        # FSDP2 skips the reduce-scatter on all but the last micro-batch and keeps each
        # parameter's whole (unsharded) fp32 gradient on every rank until the step.
        n = N if t.finetune == "full" else n_lora
        out.device.append(Term("unsharded gradients while accumulating", f"4 B × {_n(n)}", 4 * n))
    if t.strategy == "zero3" and P > 1:
        # ZeRO-3 keeps a gathered parameter whole until stage3_max_live_parameters are live, if it is
        # used again within stage3_max_reuse_distance (forward then backward): up to the whole model.
        hidden = facts.dim("hidden_size", default=0)
        try:
            zero = deepspeed_config.build(spec, workers, hidden)["zero_optimization"]
        except ValueError:  # a bad training.deepspeed override: reported on its own; estimate without it
            zero = deepspeed_config.generate(spec, workers, hidden)["zero_optimization"]
        live = min(zero["stage3_max_live_parameters"], N) if zero["stage3_max_reuse_distance"] else facts.layer_params
        out.device.append(
            Term("parameters kept gathered (stage3_max_live_parameters)", f"{_n(live)} × {c} B", live * c)
        )
    elif sharded and P > 1:
        # QLoRA gathers a layer's 4-bit codes and dequantizes one weight at a time for its matmul
        g = 0.6 if t.finetune == "qlora" else c
        if spec.rl:  # GRPO's pass keeps the whole model gathered from its rollout to its last backward
            out.device.append(Term("the whole model gathered for the step (GRPO)", f"{_n(N)} × {g} B", N * g))
        else:
            tp = plan.tensor_parallel  # a rank gathers its tp part of each layer
            layer, per_tp = facts.layer_params / tp, f" / {tp}" if tp > 1 else ""
            out.device.append(Term("gathered layers", f"2 × {_n(facts.layer_params)}{per_tp} × {g} B", 2 * layer * g))
    vocab, d = facts.dim("vocab_size", default=0), facts.dim("hidden_size", "n_embd", "d_model", default=0)
    tied = facts.config.get("tie_word_embeddings", True)
    table = "the output layer" + (", tied to the embedding" if tied else "")
    # strategies/fsdp2.py keeps a frozen output layer outside FSDP2 (plan.frozen_head_apart): split by
    # rows over the ranks where plan.splits_vocabulary allows, else whole on every rank (the other
    # ranks' rows on top of its share).
    if frozen_head_apart(spec) and P > 1:
        head = "frozen output layer" + (" (tied to the embedding)" if tied else "")
        if splits_vocabulary(spec, workers, facts.config):  # strategies/vocab_parallel.py: each rank its rows
            tokens = rank_tokens(spec)
            out.device += [
                Term(
                    f"{head} split by rows over the ranks", f"{vocab}·{d} × {w} B / {P}, in the frozen weights above", 0
                ),
                Term(
                    "every rank's hidden states gathered for the split loss, and their fp32 gradient",
                    f"{P} × {tokens}·{d} × ({c} + 4) B",
                    P * tokens * d * (c + 4),
                ),
            ]
        else:
            out.device.append(
                Term(f"{head} whole on every rank", f"{vocab}·{d} × {w} B × (1 - 1/{P})", vocab * d * w * (1 - 1 / P))
            )
    elif t.strategy == "fsdp2" and P > 1 and not spec.rl:
        # The root unit (the output layer, a tied table with it, the last norm) is gathered at the
        # first forward and kept through the backward: the largest unit gathered at once, held at the
        # loss. An untied input embedding is a unit of its own, gathered only at the first forward
        # and the last backward, when nothing else is (strategies/fsdp2.py): not at the peak.
        out.device.append(Term(f"largest gathered unit: the root ({table})", f"{vocab}·{d} × {c} B", vocab * d * c))
        if t.finetune == "full":  # whole gradients at the backward's end: a tied table's two parts and their
            # sum (benchmarks/RESULTS.md, "A tied table's gradient"), or the output layer's and the embedding's
            tables = "tied table" if tied else "output layer and embedding"
            out.device.append(Term(f"whole gradients of the {tables}", f"2 × {vocab}·{d} × {c} B", 2 * vocab * d * c))
    out.device.extend(activation_terms(spec, facts))
    out.device.extend(reward_model_terms(spec))
    out.device.extend(engine_terms(spec, facts, workers))
    out.device.append(RUNTIME_GPU if spec.scaling.use_gpu else RUNTIME_CPU)
    return out


def reward_model_terms(spec: JobSpec) -> list[Term]:
    """GRPO's reward models: a whole copy on each worker (rl/reward_model.py), fp32 (bf16 on GPUs under
    precision bf16). Sized from a local folder's headers (an adapter's base's); a hub id is not counted."""
    out = []
    c = reward_model_bytes(spec, RunPlan.of(spec).bf16)
    for reward in spec.training.grpo.rewards if spec.rl else []:
        if not reward.model:
            continue
        folder = Path(reward_model_base(reward.model))
        if not (folder / "config.json").is_file():
            continue
        n = read_facts(folder).n_params
        out.append(Term(f"reward model {reward.label} (whole, each worker)", f"{c} B × {_n(n)}", c * n))
    return out


def engine_terms(spec: JobSpec, facts: ModelFacts, workers: int) -> list[Term]:
    """`engine: vllm`'s engine beside each worker (rl/engine.py): on a GPU, the share of the device it
    takes; on a CPU node, its process, its fp32 copy of the weights and its KV cache."""
    g = spec.training.grpo if spec.rl else None
    if g is None or g.engine != "vllm":
        return []
    if spec.scaling.use_gpu:
        device = spec.scaling.accelerator_memory_gb
        return (
            [
                Term(
                    "the rollout engine (vLLM, colocated): vllm_gpu_memory_utilization × the device",
                    f"{g.vllm_gpu_memory_utilization} × {device:g} GiB",
                    g.vllm_gpu_memory_utilization * device * GiB,
                )
            ]
            if device
            else []
        )
    completions = -(-spec.training.global_batch_size // workers) * g.num_generations
    kv = engine_kv_bytes(facts.config, completions, spec.data.seq_len)
    n = facts.n_params
    return [
        Term(
            "the rollout engine (vLLM, its own process): weights + KV cache + process ≈",
            f"4 B × {_n(n)} + {size(kv)} + {ENGINE_RUNTIME_CPU_GIB} GiB",
            4 * n + kv + ENGINE_RUNTIME_CPU_GIB * GiB,
        )
    ]


# What a worker holds before any weight: CUDA's context and NCCL's buffers on a GPU; on a CPU
# worker (whose device memory is its host memory) the process itself, measured: a 0.1M-parameter
# job's busiest worker peaks at 0.77 GiB (Python, torch, transformers, Ray's worker, the data, and
# mimalloc's arenas: 0.65 GiB on glibc; benchmarks/RESULTS.md, "mimalloc for CPU workers").
RUNTIME_GPU = Term("runtime (CUDA context, NCCL) ≈", "", GiB)
RUNTIME_CPU = Term("runtime (the worker process: Python, torch, Ray) ≈", "", 0.77 * GiB)


def trainable_params(spec: JobSpec, facts: ModelFacts) -> int:
    if spec.training.finetune == "full":
        return facts.n_params
    return sum(c[4] for c in lora_counts(spec, facts))


def lora_counts(spec: JobSpec, facts: ModelFacts) -> list:
    """What peft creates for the job's targets on this model (targets.lora_counts' rows)."""
    return targets.lora_counts(
        adapters(spec, facts), spec.training.lora.rank, facts.shapes, dora=spec.training.lora.use_dora
    )


def quantized_shapes(spec: JobSpec, facts: ModelFacts) -> dict[str, tuple[int, ...]]:
    """The (out, in) weights QLoRA stores in NF4: the LoRA-adapted linear layers (not embeddings)."""
    embeddings = {n[: -len(".weight")] for n, s in facts.shapes.items() if "embed" in n or "wte" in n}
    return {
        m: facts.modules[m] for t in adapters(spec, facts).modules for m in facts.matching(t) if m not in embeddings
    }


def checkpoint_bytes(spec: JobSpec, facts: ModelFacts) -> int:
    """One whole checkpoint: every trainable parameter's saved weights and AdamW state (a LoRA
    checkpoint holds the adapter alone: fp32 weights, m and v)."""
    if spec.training.adapters:
        return 12 * trainable_params(spec, facts)
    w = DTYPE_BYTES[spec.model.dtype]
    per_param = 14 if strategies.of(spec).sixteen_bit_copy and compute_bytes(spec) == 2 else 3 * w
    return per_param * facts.n_params


def activation_terms(spec: JobSpec, facts: ModelFacts) -> list[Term]:
    # A preference micro-batch of b pairs is 2b sequences (chosen and rejected in one forward).
    b, s, c = spec.training.micro_batch_size * spec.sequences_per_row, spec.data.seq_len, compute_bytes(spec)
    sp, tp = spec.scaling.sequence_parallel, spec.scaling.tensor_parallel
    d = facts.dim("hidden_size", "n_embd", "d_model")
    n_layers = facts.dim("num_hidden_layers", "n_layer", "num_layers")
    vocab, heads = facts.dim("vocab_size"), facts.dim("num_attention_heads", "n_head", default=1)
    if not (d and n_layers and vocab):
        return [Term("activations", "unknown (config.json has no hidden_size/num_hidden_layers/vocab_size)", 0)]
    # A rank holds s/sp tokens of each sequence (Ulysses); tp splits the attention and MLP's 24 of
    # the 34 (Korthikanti et al. 2022, without sequence-parallel norms: 10 + 24/t).
    local = s // sp
    tokens = f"{b}·{s}/{sp}·{d}" if sp > 1 else f"{b}·{s}·{d}"
    impl = effective_attention(spec, facts.config)  # `auto` as the workers resolve it
    eager = impl == "eager"
    quad = 5 * heads * s / d if eager else 0  # sdpa/flash never store s×s per head
    per = 10 + (24 + quad) / tp
    layer = b * local * d * per * c / 2
    shape = f"10 + (24{f' + 5·{heads}·{s}/{d}' if quad else ''}) / {tp}" if tp > 1 or quad else "34"
    if spec.training.activation_checkpointing:
        act = Term(
            "activations (checkpointed)",
            f"{n_layers} × {tokens} × {c} B + one layer ({shape}) × {tokens} × {c}/2 B",
            n_layers * b * local * d * c + layer,
        )
    else:
        act = Term("activations", f"{n_layers} × ({shape}) × {tokens} × {c}/2 B", n_layers * layer)
    terms = [act, *merged_expert_terms(spec, facts, n_layers, c)]
    # The masks attention is given (masks.py, the rule the model path follows): whole rows' b·s²
    # under sequence parallelism too. Rows pack only in SFT with data.pack; padding is no document.
    # GPU workers in 16 bits run sdpa on torch's varlen kernel (kernels.py), which takes no mask
    varlen = masks.sdpa_varlen(impl, spec.scaling.use_gpu and c == 2, facts.config)
    built = masks.mask_windows(impl, spec.packed, masks.windows(facts.config, s), varlen)
    if built:
        mask_b = masks.mask_element_bytes(impl, c)
        why = "packed rows" if spec.packed else "causal" if impl == "eager" else "sliding window"
        count = f"{len(built)} × " if len(built) > 1 else ""
        terms.append(
            Term(
                f"attention mask{'s' * (len(built) > 1)} (s×s: {why})",
                f"{count}{b}·{s}² × {mask_b} B",
                len(built) * b * s * s * mask_b,
            )
        )
    if spec.scores:  # a reward model's head scores one position a sequence: no vocabulary logits
        return terms
    chunk = spec.loss_chunk_tokens(facts.config)
    if chunk:  # one chunk's logits exist at a time (training.chunked_loss)
        terms.append(Term("logits (one chunk)", f"{chunk}·{vocab} × ({c} + 4 + 4) B", chunk * vocab * (c + 8)))
    else:
        terms.append(Term("logits", f"{b}·{local}·{vocab} × ({c} + 4 + 4) B", b * local * vocab * (c + 8)))
    return terms + (rollout_terms(spec, facts, terms, b, s, c) if spec.rl else [])


def merged_expert_terms(spec: JobSpec, facts: ModelFacts, n_layers: int, c: int) -> list[Term]:
    """LoRA on a 3-D expert weight (peft's ParamWrapper) adds the adapter to the whole weight at each
    forward, W + B·A an expert, and autograd keeps that sum for the backward's input gradient, with two
    copies of the expert's factors for the product's: per layer not checkpointed, its adapted expert
    weights whole (tests/test_moe.py measures what the backward keeps; on benchmarks/job_memory.py's
    Qwen3-MoE, 6 layers x 36 MiB)."""
    found = adapters(spec, facts) if spec.training.adapters else None
    if found is None or not found.parameters:
        return []
    weights = factors = 0
    for name, shape in facts.shapes.items():
        leaf = next((t for t in found.parameters if targets.matches(t, name)), None)
        if leaf is None or len(shape) != 3:
            continue
        rank = found.ranks.get(leaf.rsplit(".", 1)[-1], spec.training.lora.rank)
        weights += math.prod(shape)
        factors += 2 * shape[0] * rank * (shape[1] + shape[2])
    if not weights:
        return []
    layers, n = (1 if spec.training.activation_checkpointing else n_layers), max(n_layers, 1)
    return [
        Term(
            "adapted expert weights merged at each forward, and their factors (peft ParamWrapper)",
            f"{layers} × ({_n(weights // n)} + {_n(factors // n)}) × {c} B",
            layers * (weights + factors) // n * c,
        )
    ]


def rollout_terms(spec: JobSpec, facts: ModelFacts, step: list[Term], b: int, s: int, c: int) -> list[Term]:
    """GRPO's rollout comes before the step's forwards, never beside their activations: what its
    KV cache holds beyond them (a micro-batch's completions decoded; under fsdp2 the whole model it
    reads is gathered for the whole step, counted with the weights)."""
    heads, d = facts.dim("num_attention_heads", "n_head", default=1), facts.dim("hidden_size", "n_embd", "d_model")
    kv_dim = facts.dim("num_key_value_heads", default=heads) * (d // heads)
    n_layers = facts.dim("num_hidden_layers", "n_layer", "num_layers")
    kv = 2 * n_layers * b * s * kv_dim * c
    beyond = max(0, kv - sum(t.bytes for t in step))
    return [
        Term(
            "rollout, beyond the step's activations",
            f"max(0, 2 × {n_layers} × {b}·{s} × {kv_dim} × {c} B KV cache − the terms above)",
            beyond,
        )
    ]


def adapters(spec: JobSpec, facts: ModelFacts) -> targets.Adapters:
    """The job's LoRA targets on this model, as the workers decide them (targets.decide)."""
    return targets.decide(spec, facts.modules, facts.shapes, facts.config)


# ---------------------------------------------------------------- the smallest change that fits
@dataclass
class Change:
    text: str  # as the user writes it: "training.activation_checkpointing: true"
    training: dict = field(default_factory=dict)  # field updates of the training section
    workers: int | None = None

    def apply(self, spec: JobSpec) -> JobSpec:
        t = dict(self.training)
        if "offload" in t:
            t["offload"] = spec.training.offload.model_copy(update=t["offload"])
        return spec.model_copy(update={"training": spec.training.model_copy(update=t)})


def _options(spec: JobSpec, n: int):
    """Lists of alternative single changes, in the usual order of their cost to throughput;
    within a list, from the mildest to the strongest."""
    t, hi = spec.training, spec.scaling.worker_range[1]
    yield [
        Change(f"training.micro_batch_size: {m}", {"micro_batch_size": m}) for m in range(t.micro_batch_size - 1, 0, -1)
    ]
    if not t.activation_checkpointing:
        yield [Change("training.activation_checkpointing: true", {"activation_checkpointing": True})]
    if compute_bytes(spec) == 4:
        yield [Change("training.precision: bf16", {"precision": "bf16"})]
    if strategies.of(spec).replicated:
        yield [Change("training.strategy: fsdp2", {"strategy": "fsdp2"})]
    elif not t.offload.optimizer:
        yield [Change("training.offload.optimizer: true", {"offload": {"optimizer": True}})]
    if strategies.of(spec).offload == "apart" and not t.offload.params:
        yield [Change("training.offload.params: true", {"offload": {"params": True}})]
    if t.finetune == "full":
        yield [Change("training.finetune: lora", {"finetune": "lora"})]
    if not strategies.of(spec).replicated:  # more devices: the last resort, it costs money rather than speed
        key = "num_workers" if spec.scaling.num_workers else "min_workers"
        group = spec.scaling.model_parallel  # whole sequence- and tensor-parallel groups only
        yield [
            Change(f"scaling.{key}: {k}" + (f" and scaling.max_workers: {k}" if k > hi else ""), workers=k)
            for k in range(n + group, min(t.global_batch_size * group, max(64, 8 * n)) + 1, group)
        ]


def smallest_fix(spec: JobSpec, facts: ModelFacts, budget: float) -> tuple[str, Estimate] | None:
    """The first single change that fits; else the cheapest changes combined; else None."""
    n = spec.scaling.worker_range[0]
    for alternatives in _options(spec, n):
        for change in alternatives:
            e = estimate(change.apply(spec), facts, change.workers or n)
            if e.total <= budget:
                return change.text, e
    texts, current = [], spec
    for alternatives in _options(spec, n):
        if alternatives and alternatives[-1].workers is None:  # combinations stay on the same devices
            current, texts = alternatives[-1].apply(current), texts + [alternatives[-1].text]
            e = estimate(current, facts, n)
            if e.total <= budget:
                return " + ".join(texts), e
    return None
