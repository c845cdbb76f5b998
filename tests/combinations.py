"""Every option with every other: an all-pairs covering set over the job's options, each case
either trained against its plain data-parallel reference or refused by `raytrain validate`.

The options are read from the config's own types (`options()`): every `Literal` and `bool` field of
`training` (less `auto`), the attention implementation, packing, the sequence- and tensor-parallel
degrees 4 ranks can hold, the model (a Llama, and a Mistral with a sliding window shorter than
a row), and GRPO's own two that change what a worker runs (a second update on each rollout, a reward
model beside the reward function; tried under objective: grpo). A new Literal or bool field of
`training` joins the set without a change here.

`covering()` picks cases greedily until every pair of option values is in a case that validates,
or is refused on its own (the defaults plus that pair), by the same checks `raytrain validate` runs
(the schema's rules, then the model-dependent mesh rule). `run_cases` trains each case and each
reference on 4 gloo ranks (spawned processes, tests/gpu/local_run.py: Ray is not the point here)
with the product's strategy and step (`loop.train_step`), as tests/mesh_cases.py does.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
import typing
from pathlib import Path

import families

WORLD = 4
SEQ = 64
# Two steps: before and after one update, where a wrong mask or exchange shows from the first step on.
# A third held nothing more, and drifts in bf16: fsdp2 computes in bf16 parameters (a bf16 residual
# stream), the DDP reference under autocast over fp32 ones; seen, full-FT KTO with sp=2, tp=2 6.5% off
# at step 3 after 0.36% at step 2, while in fp32 it agrees to 1e-7.
STEPS = 2
SKIPPED = {
    "preference",
    "lora",
    "global_batch_size",
    "max_steps",
    "seed",
    "grad_clip",
    "deepspeed",
    "offload",
    "chunked_loss",
    "micro_batch_size",
}  # values, not options; the last three are set below
REFERENCE = {
    "strategy": "ddp",
    "sequence_parallel": 1,
    "tensor_parallel": 1,
    "attention": "sdpa",
    "micro_batch_size": 1,
}  # + every bool off; what a case keeps: MATH_KEYS
# GRPO's own options: a second update on each rollout's completions (TRL's mu), and a reward model
# beside the lipogram function (a second model in every worker). They mean something under objective:
# grpo only (validate refuses a training.grpo section under another objective, naming its fields), so a
# pair holding one is tried under grpo unless the pair sets the objective itself.
GRPO_ONLY = {"num_iterations": (1, 2), "reward_model": (False, True)}
MATH_KEYS = ("objective", "finetune", "dora", "pack", "precision", "model", *GRPO_ONLY)  # what changes the numbers
FIELDS = {
    "sequence_parallel": "scaling.sequence_parallel",
    "tensor_parallel": "scaling.tensor_parallel",
    "attention": "model.attn_implementation",
    "pack": "data.pack",
    "model": "model.path",
    "dora": "training.lora.use_dora",
    "num_iterations": "training.grpo.num_iterations",
    "reward_model": "training.grpo.rewards",
}


def options() -> dict[str, tuple]:
    from raytrain.job.sections import ModelSpec
    from raytrain.job.training import TrainingSpec

    out: dict[str, tuple] = {}
    for name, field in TrainingSpec.model_fields.items():
        if name in SKIPPED:
            continue
        if field.annotation is bool or bool in typing.get_args(field.annotation):  # a bool, or auto | bool
            out[name] = (False, True)
        elif typing.get_origin(field.annotation) is typing.Literal:
            out[name] = tuple(v for v in typing.get_args(field.annotation) if v != "auto")
    out.update(chunked_loss=(False, True), offload=(False, True), micro_batch_size=(1, 2), dora=(False, True))
    out.update(
        sequence_parallel=(1, 2, 4),
        tensor_parallel=(1, 2),
        pack=(False, True),
        attention=tuple(
            a for a in typing.get_args(ModelSpec.model_fields["attn_implementation"].annotation) if a != "auto"
        ),
        model=("llama", "mistral window"),
        **GRPO_ONLY,
    )
    return out


def named(option: str) -> set[str]:
    """What validate's refusal of a pair must name for `option`: its field; for GRPO's own options, or
    the objective they imply (the pair was tried under grpo, and grpo is what the other option refuses)."""
    return {field_of(option).rsplit(".", 1)[-1]} | ({"objective"} if option in GRPO_ONLY else set())


def grpo_section(case: dict, models: dict) -> dict | None:
    """The case's training.grpo: the demo's under grpo; under another objective only what the case
    sets of GRPO's own options (validate refuses it)."""
    from mesh_cases import GRPO

    extra = {"num_iterations": case["num_iterations"]} if case["num_iterations"] != 1 else {}
    if case["reward_model"]:
        extra["rewards"] = [*GRPO["rewards"], {"model": models["reward model"]}]
    return {**GRPO, **extra} if case["objective"] == "grpo" else extra or None


def field_of(option: str) -> str:
    return FIELDS.get(option, f"training.{option}")


def job(case: dict, models: dict, storage: str) -> dict:
    """The job YAML (a dict) of a case."""
    rl = case["objective"] == "grpo"  # prompt rows; the rollouts sample what is trained
    rows = "prompts" if rl else "pairs" if case["objective"] != "sft" else "text"
    training = {k: v for k, v in case.items() if k not in FIELDS and k != "offload"}
    training.update(
        global_batch_size=8,
        max_steps=STEPS,
        seed=0,
        lora={"rank": 4, "alpha": 8, "dropout": 0.0, "use_dora": case["dora"]},
        offload={"optimizer": case["offload"], "params": case["offload"]},
    )
    grpo = grpo_section(case, models)
    if grpo:
        training["grpo"] = grpo
    return {
        "name": "combo",
        "model": {"path": models[case["model"]], "attn_implementation": case["attention"].split()[0]},
        "data": {"path": models[rows], "seq_len": SEQ, "pack": case["pack"], **({"format": "prompt"} if rl else {})},
        "training": training,
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "scaling": {
            "num_workers": WORLD,
            "sequence_parallel": case["sequence_parallel"],
            "tensor_parallel": case["tensor_parallel"],
        },
        "checkpoint": {"storage_path": storage},
        "tracking": {"experiment": "tests"},
    }


def refusal(case: dict, models: dict, configs: dict) -> str | None:
    """Why validate refuses the case (its messages joined), or None. The schema's rules, then the
    model's mesh rule: what `raytrain validate` says before its probes of the world."""
    from pydantic import ValidationError

    from raytrain.job.implementations import attention_problem, source_flags
    from raytrain.job.plan import model_parallel_problems
    from raytrain.job.spec import JobSpec
    from raytrain.model import targets
    from raytrain.model.facts import read_facts

    try:
        spec = JobSpec.model_validate(job(case, models, "/tmp/unused"))
    except ValidationError as exc:
        return "; ".join(e["msg"] for e in exc.errors())
    config = configs[case["model"]]
    problems = model_parallel_problems(config, case["sequence_parallel"], case["tensor_parallel"])
    flags = source_flags(config)  # the model class's attention (validate's rule)
    why = attention_problem(flags, spec.model.attn_implementation) if flags else None
    if why:
        problems.append(("model.attn_implementation", spec.model.attn_implementation, why))
    if spec.training.adapters:  # what peft refuses with an MoE's experts adapted (validate's rule)
        facts = read_facts(Path(models[case["model"]]))
        chosen = targets.decide(spec, facts.modules, facts.shapes, facts.config)
        problems += targets.expert_problems(spec, chosen, facts.shapes)
    return "; ".join(f"{field}={value}: {fix}" for field, value, fix in problems) or None


def defaults(opts: dict) -> dict:
    return {name: REFERENCE.get(name, values[0]) for name, values in opts.items()} | {"strategy": "fsdp2"}


def covering(opts: dict, refused, seed: int = 0) -> tuple[list[dict], dict]:
    """(cases, refused pairs): cases that validate and together hold every pair of option values
    that does not fail validation by itself; the pairs that do, with validate's message."""
    names = list(opts)
    pairs = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2) for va in opts[a] for vb in opts[b]}
    base = defaults(opts)

    def tried(*pair) -> dict:  # the defaults and the pair, under grpo where it holds GRPO's own options
        case = {**base, **dict(pair)}
        if "objective" not in dict(pair) and any(case[o] != values[0] for o, values in GRPO_ONLY.items()):
            case["objective"] = "grpo"
        return case

    refused_pairs = {}
    for (a, va), (b, vb) in sorted(pairs, key=repr):
        why = refused(tried((a, va), (b, vb)))
        if why:
            refused_pairs[((a, va), (b, vb))] = why
    todo = pairs - refused_pairs.keys()
    rng, cases = random.Random(seed), []

    def covers(case):
        return {p for p in todo if case[p[0][0]] == p[0][1] and case[p[1][0]] == p[1][1]}

    while todo:
        best, gain = None, set()
        for _ in range(30):
            (a, va), (b, vb) = rng.choice(sorted(todo, key=repr))
            case = tried((a, va), (b, vb))
            for name in rng.sample(names, len(names)):  # the case stays valid at every step
                if name in (a, b):
                    continue
                for value in sorted(opts[name], key=lambda v: -len(covers({**case, name: v})) - rng.random()):
                    if value == case[name] or refused({**case, name: value}) is None:
                        case[name] = value
                        break
            got = covers(case)
            if len(got) > len(gain):
                best, gain = dict(case), got
        if best is None:  # no random case holds what is left: it cannot be held with this world size
            break
        cases.append(best)
        todo -= gain
    return cases, {"pairs": refused_pairs, "unheld": sorted(todo, key=repr)}


# The families users start from beyond the pair axis's two models (tests/families.py): each takes the place of
# the demo Llama in cases (`with_families`: a full fine-tune, one that is not, or both), where every pair that case
# holds is held by another case too. The mixtures of experts first (they take fp32 cases only, MOE_FAMILIES), each
# in a LoRA case (its experts adapted) and a full one; a family whose parts another holds in one case: Qwen3's
# q/k norms and tied table (Qwen2's biased q/k/v are gpt-oss's too), Gemma 3's scaled embedding, GeGLU and
# per-head norms (Gemma's, with windows on alternate layers).
EXTRA_FAMILIES = {
    "qwen3-moe": (False, True),
    "gpt-oss": (False, True),
    "qwen3 tied": (False, True),
    "gemma3": (False, True),
    "phi3": (False,),
    "gpt-neox": (True,),
}
# A mixture of experts routes each token to its top-k experts: bf16's rounding (fsdp2's bf16 parameters against
# the reference's autocast over fp32 ones) flips near-tied choices, which changes the loss by more than rounding.
# Its cases are fp32 ones, where the same tokens pick the same experts under every layout.
MOE_FAMILIES = ("qwen3-moe", "gpt-oss")
PAIR_MODELS = ("llama", "mistral window")


def with_families(cases: list[dict], refused) -> list[dict]:
    """`cases` with each of EXTRA_FAMILIES as the model of the cases it asks for (a full fine-tune when True),
    each one that held a pair-axis model (the Llama, the windowed Mistral), where another case of that model
    holds every other option's value of it (the covering set keeps all its pairs) and validate takes the family
    there (the tensor-parallel plan knows Llama-style blocks only; peft's ParamWrapper takes no DoRA)."""
    cases = [dict(c) for c in cases]
    for family, kinds in EXTRA_FAMILIES.items():
        for full in kinds:
            for case in cases:
                others = [c for c in cases if c is not case and c["model"] == case["model"]]
                if (
                    case["model"] in PAIR_MODELS
                    and (case["finetune"] == "full") == full
                    and (family not in MOE_FAMILIES or case["precision"] == "fp32")
                    and refused({**case, "model": family}) is None
                    and all(any(o[name] == value for o in others) for name, value in case.items() if name != "model")
                ):
                    case["model"] = family
                    break
    return cases


# sdpa on torch's varlen kernel, what GPU workers in 16 bits run (kernels.py): on CPU through
# tests/varlen.py's reference of torch's calling convention, in place of the masks a CPU gets.
VARLEN = "sdpa varlen"


def with_varlen(cases: list[dict]) -> list[dict]:
    """`cases` and a copy of three sdpa cases run on the varlen kernel: one of packed SFT rows, one
    with a sliding window under sequence parallelism, one compiled (where the covering set has
    them). A copy's reference is its case's, on sdpa's masks: each compares the kernel too."""
    wanted = (
        lambda c: c["objective"] == "sft" and c["pack"],
        lambda c: c["model"] == "mistral window" and c["sequence_parallel"] > 1,
        lambda c: c["compile"],
    )
    copies = []
    for want in wanted:
        found = next(
            (c for c in cases if c["attention"] == "sdpa" and want(c) and {**c, "attention": VARLEN} not in copies),
            None,
        )
        if found is not None:
            copies.append({**found, "attention": VARLEN})
    return cases + copies


def reference_of(case: dict, opts: dict) -> dict:
    """The plain data-parallel job with the numbers of `case`: DDP, no sp/tp, every other option off."""
    ref = {
        name: False if opts[name] == (False, True) else REFERENCE.get(name, values[0]) for name, values in opts.items()
    }
    ref.update({k: case[k] for k in MATH_KEYS})
    if case["model"] in families.NO_SDPA:  # a class without sdpa: the reference's attention is eager
        ref["attention"] = "eager"
    if case["finetune"] == "qlora":  # an NF4 base is sharded by fsdp2 alone (validate refuses ddp)
        ref["strategy"] = "fsdp2"
    if case["objective"] != "sft":
        ref["pack"] = False  # pairs never pack: the option does nothing to them
    return ref


def key(case: dict) -> str:
    return json.dumps(case, sort_keys=True)


def run_cases(rank: int, world: int, device, cases: list[str], models: dict, storage: str, resumed: list[str]) -> dict:
    """On every rank (spawned): each case's per-step losses, grad norms and metric means; for those
    in `resumed`, its checkpoint after the last step restored by a fresh strategy and the next step
    taken both ways (mesh_cases.run_case)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import mesh_cases
    import torch
    import varlen

    from raytrain.job.spec import JobSpec

    varlen.install()  # flash_attention_2 through transformers' integration, flash-attn's kernels in torch
    out = {}
    for text in cases:
        case = json.loads(text)
        varlen.install_torch_varlen(case["attention"] == VARLEN)
        if case["compile"]:  # an empty dynamo cache, as a job's own process starts with: cases share this one, and
            # another case's graphs and recompile count decided which ran (seen: 1e-7 off on resume)
            torch.compiler.reset()
        spec = JobSpec.model_validate(job(case, models, storage))
        pairs = case["objective"] != "sft"  # the store never packs pairs (or prompts), whatever data.pack says
        rows = (
            mesh_cases.grpo_rows(models[case["model"]], 8, seq=SEQ)
            if case["objective"] == "grpo"
            else mesh_cases.global_rows(
                pairs,
                case["pack"] and not pairs,
                8,
                seq=SEQ,
                kto=case["objective"] == "kto",
                margins=case["objective"] == "reward",
            )
        )
        # A DoRA adapter is exported as the job's export writes it (collective), for plain peft to load.
        export = f"{storage}/exports/{hashlib.sha1(text.encode()).hexdigest()[:12]}" if case["dora"] else None
        began = time.perf_counter()
        try:
            result = mesh_cases.run_case(spec, rows, steps=STEPS, export_to=export, resume=text in resumed)
        except Exception as exc:  # name the case: the spawned traceback alone does not
            raise RuntimeError(f"case {text} failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
        out[text] = {
            **{k: result.get(k) for k in ("losses", "grad_norms", "means", "rewards", "continued", "resumed")},
            "export": export,
            "seconds": round(time.perf_counter() - began, 1),
        }
    return out
