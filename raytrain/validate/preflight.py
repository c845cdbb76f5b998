"""Pre-flight: everything that can be checked on the driver, in seconds, before Ray starts
or a GPU is allocated. Every problem is collected (not just the first) and names the YAML
path, the bad value and the fix. No torch import here.

The schema is checked whole; when a section is broken, the others are still validated
one by one and probed, so one typo does not hide a missing dataset. Probes of the world
(model files, memory, data, storage, MLflow) only look at sections that validated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from struct import error as StructError

import yaml
from pydantic import BaseModel, ValidationError

from raytrain import allocator
from raytrain.job import nf4_layout
from raytrain.job.grpo import engine_model_problems, vllm_python
from raytrain.job.implementations import AUTO, attention_problem, choose_attention, source_flags
from raytrain.job.plan import RunPlan, model_parallel_problems
from raytrain.job.spec import JobSpec, apply_overrides
from raytrain.model import moe, targets
from raytrain.model.facts import ModelFacts, read_facts
from raytrain.rundir import storage
from raytrain.validate import agents, memory, probes
from raytrain.validate.problems import (
    ERROR,
    NOTE,
    Problem,
    cross_field,
    did_you_mean,
    duplicate_keys,
    from_validation_error,
    is_hub_id,
    secret_problems,
)

OVERRIDE_ALIASES = {"train.": "training.", "optim.": "optimizer.", "ckpt.": "checkpoint."}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
ROOT_RULE_INPUTS = {"training", "scaling", "model"}  # sections JobSpec's cross-field rules read


@dataclass
class Report:
    spec: JobSpec | None  # None when there is any error
    problems: list[Problem]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def notes(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == NOTE]


def load_raw(path: str, overrides: list[str]) -> tuple[dict | None, list[Problem]]:
    file = Path(path)
    if not file.is_file():
        return None, [
            Problem(
                "(job file)", repr(path), "no such file; pass the path of a job YAML, e.g. jobs/quickstart.yaml", "file"
            )
        ]
    try:
        text = file.read_text()
        raw = yaml.safe_load(text)  # safe_load only: a job file never runs code
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        return None, [
            Problem("(job file)", repr(path), f"not valid YAML at {where}: {getattr(exc, 'problem', exc)}", "file")
        ]
    if not isinstance(raw, dict):
        return None, [
            Problem("(job file)", repr(path), "a job is a YAML mapping with name:, model:, data:, ...", "file")
        ]
    fixed = []
    for text_ in overrides:
        for short, full in OVERRIDE_ALIASES.items():
            text_ = full + text_[len(short) :] if text_.startswith(short) else text_
        fixed.append(text_)
    try:
        return apply_overrides(raw, fixed), duplicate_keys(text)
    except (ValueError, yaml.YAMLError) as exc:
        return None, [Problem("--set", "", str(exc).splitlines()[0], "file")]


def absolutize(raw: dict, base: str) -> dict:
    """Workers run in another directory: local paths become absolute on the driver. A model
    path that is not a local folder is left alone (a hub id)."""
    model, data, ck = raw.get("model") or {}, raw.get("data") or {}, raw.get("checkpoint") or {}
    sources = [s for s in (data.get("sources") or []) if isinstance(s, dict)] if isinstance(data, dict) else []
    evaluation = data.get("eval") if isinstance(data, dict) and isinstance(data.get("eval"), dict) else {}
    grpo = (raw.get("training") or {}).get("grpo") if isinstance(raw.get("training"), dict) else None
    rewards = [r for r in (grpo.get("rewards") or []) if isinstance(r, dict)] if isinstance(grpo, dict) else []
    for section, key, always in (
        (model, "path", False),
        (model, "tokenizer", False),
        (data, "path", True),
        *((s, "path", True) for s in sources),
        (evaluation, "path", True),
        *((r, "model", False) for r in rewards),
        (data, "sample_log", True),
        (ck, "storage_path", True),
    ):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, str) and value and not storage.is_remote(value):
            if always or Path(base, value).exists():
                section[key] = storage.absolute(value, base)
    return raw


def check(path: str, overrides: list[str] = (), probes: bool = True, network_required: bool = False) -> Report:
    """All problems of a job: errors refuse it, notes are said. `network_required` (run):
    what this machine cannot reach is an error rather than a note."""
    raw, problems = load_raw(path, list(overrides))
    if raw is None:
        return Report(None, problems)
    problems += secret_problems(raw)
    problems += [Problem(*p, "environment") for p in allocator.problems(os.environ)]
    flagged = {p.field for p in problems if p.kind == "security"}
    raw = absolutize(raw, os.getcwd())
    try:
        spec, broken = JobSpec.model_validate(raw), set()
    except ValidationError as exc:
        problems += [p for p in from_validation_error(exc) if p.field not in flagged]
        spec, broken = salvage(raw, exc)
        if broken and not broken & ROOT_RULE_INPUTS:  # rules that did not run because another section failed
            problems += root_rule_problems(spec)
    if not broken & {"training", "scaling"}:
        problems += speed_notes(spec)
    if probes:  # a section holding a secret is not probed: a URI with a password is not used, even to knock
        problems += probe(spec, broken | {f.split(".")[0] for f in flagged}, network_required)
    errors = any(p.severity == ERROR for p in problems)
    return Report(None if errors else spec, problems)


def speed_notes(spec: JobSpec) -> list[Problem]:
    """What a valid job costs that another setting measurably saves (benchmarks/RESULTS.md)."""
    t = spec.training
    if t.strategy == "zero3" and t.adapters and spec.scaling.use_gpu:
        return [
            Problem(
                "training.strategy",
                "zero3",
                "LoRA under ZeRO-3 ran at 0.23x fsdp2's tokens/s on an H200 "
                '(6,001 against 25,609, a 1.1B Llama at 4k tokens, benchmarks/RESULTS.md "The first GPU '
                'figures"); its cause is not yet found. For a new run, training.strategy: fsdp2 trains the '
                "same job",
                "speed",
                NOTE,
            )
        ]
    return []


def check_job(path: str, overrides: list[str] = (), probes: bool = True) -> tuple[JobSpec | None, list[Problem]]:
    """(spec, errors): the spec is None when there is any error."""
    report = check(path, overrides, probes)
    return report.spec, report.errors


def salvage(raw: dict, exc: ValidationError) -> tuple[JobSpec, set[str]]:
    """The sections that validate on their own, with placeholders for the broken ones (never probed)."""
    broken = {"name"} if any(tuple(e["loc"]) == ("name",) for e in exc.errors()) else set()
    parts = {}
    for name, info in JobSpec.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            try:
                parts[name] = ann.model_validate(raw.get(name, info.default))
                continue
            except (ValidationError, TypeError):
                broken.add(name)
                parts[name] = ann.model_construct(path="(invalid)") if name in ("model", "data") else ann()
        else:
            parts[name] = raw.get(name) if name not in broken and isinstance(raw.get(name), str) else "invalid"
    return JobSpec.model_construct(**parts), broken


def root_rule_problems(spec: JobSpec) -> list[Problem]:
    out = []
    for decorator in JobSpec.__pydantic_decorators__.model_validators.values():
        if decorator.info.mode == "after":
            try:
                decorator.func(spec)
            except ValueError as exc:
                out.append(cross_field((), str(exc), None))
    return out


# ---------------------------------------------------------------- probes of the world outside the YAML
def probe(spec: JobSpec, broken: set[str], network_required: bool) -> list[Problem]:
    ok = lambda *sections: not broken & set(sections)  # noqa: E731 - reads as the rule it is
    checks = []
    if ok("model"):
        checks.append(("model.path", lambda: model_problems(spec, broken)))
    if ok("data"):
        checks.append(("data.path", lambda: probes.data_problems(spec, network_required)))
    if ok("training") and spec.rl:
        checks.append(("training.grpo.rewards", lambda: probes.reward_problems(spec)))
        if spec.training.grpo.agents and ok("model"):
            checks.append(("training.grpo.tools", lambda: agents.problems(spec)))
    if ok("checkpoint"):
        checks.append(("checkpoint.storage_path", lambda: probes.storage_problems(spec, network_required)))
    if ok("checkpoint", "tracking"):
        checks.append(("tracking.uri", lambda: probes.tracking_problems(spec, network_required)))
    out = []
    for field, run in checks:
        try:
            out += run()
        except Exception as exc:  # a probe's own bug must not print a traceback or block a good job
            out.append(
                Problem(
                    field,
                    "",
                    f"not checked: the probe failed ({type(exc).__name__}: {exc}); please report this",
                    "internal",
                    NOTE,
                )
            )
    return out


def model_folder(spec: JobSpec) -> tuple[Path | None, bool, list[Problem]]:
    """(folder, from the cache, problems): a local folder, or the Hugging Face cache snapshot
    of a hub id (which may hold config.json alone); None for a hub id not in the cache."""
    path = spec.model.path
    if Path(path).is_dir():
        return Path(path), False, []
    if Path(path).exists() or not is_hub_id(path):
        return (
            None,
            False,
            [
                Problem(
                    "model.path",
                    repr(path),
                    "no such folder, and not a hub id (org/name); give a local "
                    "Hugging Face model folder or a hub id like meta-llama/Llama-3.1-8B",
                    "model",
                )
            ],
        )
    from huggingface_hub import try_to_load_from_cache  # the cache on disk only: never the network

    cached = try_to_load_from_cache(path, "config.json", revision=spec.model.revision)
    if isinstance(cached, str):
        return Path(cached).parent, True, []
    return (
        None,
        False,
        [
            Problem(
                "model.path",
                repr(path),
                "a hub id, not in the local Hugging Face cache, and nothing is "
                "downloaded here: its architecture, LoRA targets, context window and memory are checked on the "
                f"cluster when the workers load it (to check them here first: hf download {path} config.json)",
                "model",
                NOTE,
            )
        ],
    )


def model_facts(spec: JobSpec) -> ModelFacts | None:
    """The model's dimensions where they can be read here (a local folder or the local hub
    cache), else None; never the network."""
    folder = model_folder(spec)[0]
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        return read_facts(folder)
    except (OSError, ValueError, KeyError, StructError):
        return None


def model_problems(spec: JobSpec, broken: set[str]) -> list[Problem]:
    folder, cached, out = model_folder(spec)
    path = repr(spec.model.path)
    if folder is None:
        return out
    if not (folder / "config.json").is_file():
        return [Problem("model.path", path, "folder has no config.json; point at a Hugging Face model folder", "model")]
    try:
        facts = read_facts(folder)
    except (OSError, ValueError, KeyError, StructError) as exc:
        return [
            Problem(
                "model.path",
                path,
                f"cannot read the model's config or weight headers ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                "model",
            )
        ]
    config = facts.config
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        out.append(
            Problem(
                "model.path",
                path,
                f"architecture {archs} is not a causal LM (…ForCausalLM); "
                "raytrain fine-tunes decoder-only language models",
                "model",
            )
        )
    out += remote_code_problems(spec, folder, config)
    if "training" not in broken:
        engine = engine_model_problems(spec, config)
        out += [
            Problem("training.grpo.engine", "vllm", text, "model", ERROR if error else NOTE) for text, error in engine
        ]
        if spec.rl and spec.training.grpo.engine == "vllm" and not engine and vllm_python().is_file():
            out.append(
                Problem(
                    "training.grpo.engine",
                    "vllm",
                    f"rollouts on a vLLM engine beside each worker, run by {vllm_python()} (RAYTRAIN_VLLM_PYTHON)",
                    "environment",
                    NOTE,
                )
            )
    window = config.get("max_position_embeddings") or config.get("n_positions")
    if window and spec.data.seq_len > window and "data" not in broken:
        out.append(
            Problem(
                "data.seq_len",
                str(spec.data.seq_len),
                f"longer than the model's context window ({window}); use data.seq_len <= {window}",
                "model",
            )
        )
    out += moe_and_attention_problems(spec, facts, broken)
    if "training" not in broken and spec.training.adapters and facts.exact_names:
        out += lora_problems(spec, facts)
    if not broken & {"training", "scaling"} and spec.training.finetune == "qlora" and facts.exact_names:
        out += qlora_problems(spec, facts)
    if "scaling" not in broken:
        out += [
            Problem(field, value, text, "model")
            for field, value, text in model_parallel_problems(
                config, spec.scaling.sequence_parallel, spec.scaling.tensor_parallel
            )
        ]
    if not cached:  # a cache snapshot may hold config.json alone: its tokenizer is the cluster's to load
        out += tokenizer_problems(spec, folder, broken)
    if not broken & {"training", "scaling", "data"} and not any(p.severity == ERROR for p in out):
        out += memory_problems(spec, facts)
    return out


def remote_code_problems(spec: JobSpec, folder: Path, config: dict) -> list[Problem]:
    """`trust_remote_code` must be explicit: a model that ships code needs a yes written in the job."""
    tok_config = folder / "tokenizer_config.json"
    ships_code = bool(config.get("auto_map")) or (
        tok_config.is_file() and "auto_map" in json.loads(tok_config.read_text())
    )
    said = "trust_remote_code" in spec.model.model_fields_set
    if ships_code and not spec.model.trust_remote_code:
        how = "is false" if said else "is not set"
        return [
            Problem(
                "model.trust_remote_code",
                str(spec.model.trust_remote_code).lower(),
                f"this model ships its own "
                f"Python code (auto_map) and model.trust_remote_code {how}; set model.trust_remote_code: true "
                "if you trust that code (it runs on every worker), or use a model without custom code",
                "security",
            )
        ]
    if spec.model.trust_remote_code and not ships_code:
        return [
            Problem(
                "model.trust_remote_code",
                "true",
                "this model ships no code of its own: set it to false",
                "security",
                NOTE,
            )
        ]
    return []


def qlora_problems(spec: JobSpec, facts: ModelFacts) -> list[Problem]:
    """Every worker count the job may run with must split each NF4 weight into whole rows of
    blocks (nf4_layout.py): a resize to one that does not would fail at load."""
    shapes, plan = memory.quantized_shapes(spec, facts), RunPlan.of(spec)
    lo, hi = spec.scaling.worker_range
    bad = {n: nf4_layout.shard_problems(shapes, plan.shard_degree(n)) for n in range(lo, hi + 1)}
    bad = {n: why for n, why in bad.items() if why}
    if not bad:
        return []
    good = [n for n in range(lo, hi + 1) if n not in bad]
    first = next(iter(bad.values()))
    fix = f"run with {', '.join(map(str, good))} workers" if good else "choose a worker count that divides them"
    return [
        Problem(
            "training.finetune",
            "qlora",
            f"the adapted layers' NF4 weights cannot be sharded by whole rows "
            f"over {', '.join(map(str, bad))} workers ({'; '.join(first[:3])}): {fix}, or use "
            "training.finetune: lora",
            "model",
        )
    ]


def lora_problems(spec: JobSpec, facts: ModelFacts) -> list[Problem]:
    """The job's LoRA targets on this model (targets.decide, the workers' rule): each target that names
    nothing, each option peft refuses with experts adapted, and the audit (a note) of what is adapted."""
    chosen = memory.adapters(spec, facts)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in facts.modules})
    params = sorted({n.rsplit(".", 1)[-1] for n, s in facts.shapes.items() if len(s) == 3})
    has = f"its linear layers and embeddings: {', '.join(leaves)}" + (
        f"; its 3-D (expert) parameters: {', '.join(params)}" if params else ""
    )
    out = [
        Problem(field, value, why, "model") for field, value, why in targets.expert_problems(spec, chosen, facts.shapes)
    ]
    lora = spec.training.lora
    if lora.target_modules is None and not chosen.modules and not chosen.parameters:
        return out + [
            Problem(
                "training.lora.target_modules",
                "",
                "none of raytrain's default LoRA targets are in this model; list some of its layers: "
                + ", ".join(leaves),
                "model",
            )
        ]
    for t in targets.unmatched(chosen, facts.modules, facts.shapes):
        field = (
            "training.lora.target_modules" if t in (lora.target_modules or []) else "training.lora.target_parameters"
        )
        names = leaves if field.endswith("modules") else sorted({n.rsplit(".", 1)[-1] for n in facts.shapes})
        out.append(
            Problem(
                field,
                repr(t),
                f"no {field.rsplit('_', 1)[-1][:-1]} {t!r} in this model; {did_you_mean(t, names)}{has}",
                "model",
            )
        )
    if not out:
        rewritten = (
            f" (peft 0.21 turns target_modules {', '.join(chosen.rewritten)} into parameters on this family)"
            if chosen.rewritten
            else ""
        )
        audit = targets.audit(memory.lora_counts(spec, facts), facts.shapes, full=False)
        if spec.training.finetune == "qlora" and chosen.parameters:
            rewritten += f" (qlora: NF4 for the adapted linear layers; {', '.join(chosen.parameters)} stay as loaded)"
        out.append(Problem("training.lora", "", f"adapters: {audit}{rewritten}", "model", NOTE))
    return out


def moe_and_attention_problems(spec: JobSpec, facts: ModelFacts, broken: set[str]) -> list[Problem]:
    """The model class's attention against model.attn_implementation (job/implementations.py), and the
    router's balancing loss against a model that has no router."""
    out, config = [], facts.config
    flags, requested = source_flags(config), spec.model.attn_implementation
    if flags is not None and "model" not in broken:
        problem = attention_problem(flags, requested)
        if problem:
            out.append(Problem("model.attn_implementation", requested, problem, "model"))
        elif requested == AUTO:
            chosen, why = choose_attention(flags, "cuda" if spec.scaling.use_gpu else "cpu", RunPlan.of(spec).bf16)
            if chosen != "sdpa":  # sdpa is what a job without the field ran before: said only when it is not
                out.append(Problem("model.attn_implementation", AUTO, f"{chosen} ({why})", "model", NOTE))
    if "training" not in broken:
        problem = moe.router_aux_problem(spec.training.router_aux_loss_coef, config)
        if problem:
            out.append(
                Problem("training.router_aux_loss_coef", f"{spec.training.router_aux_loss_coef:g}", problem, "model")
            )
    return out


def tokenizer_problems(spec: JobSpec, folder: Path, broken: set[str]) -> list[Problem]:
    tok = spec.model.tokenizer
    if tok is not None and not Path(tok).is_dir():
        if Path(tok).exists() or not is_hub_id(tok):
            return [Problem("model.tokenizer", repr(tok), "no such folder, and not a hub id", "model")]
        return []  # a hub id: loaded on the cluster
    tok_dir = Path(tok) if tok else folder
    if not any((tok_dir / f).is_file() for f in TOKENIZER_FILES):
        return [
            Problem(
                "model.tokenizer",
                repr(tok),
                f"{tok_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                "set model.tokenizer to a tokenizer folder or hub id",
                "model",
            )
        ]
    if "data" in broken or all(d.format in ("text", "prompt") for _, d in spec.data.named_inputs()):  # prompt: its
        # plain prompts need no template; a conversational one without it is a bad row, named
        return []
    config = tok_dir / "tokenizer_config.json"
    has_template = (
        (tok_dir / "chat_template.jinja").is_file()
        or (tok_dir / "chat_template.json").is_file()
        or (config.is_file() and json.loads(config.read_text()).get("chat_template"))
    )
    if has_template:
        return []
    return [
        Problem(
            "data.format",
            repr(spec.data.format),
            f"conversations (chat, alpaca, sharegpt) are rendered with the "
            f"tokenizer's chat template and the tokenizer in {tok_dir} has none; "
            "use an instruct/chat model's tokenizer (model.tokenizer) or add chat_template.jinja",
            "data",
        )
    ]


def memory_problems(spec: JobSpec, facts: ModelFacts) -> list[Problem]:
    if not facts.shapes:
        return [
            Problem(
                "scaling.accelerator_memory_gb",
                "",
                "not estimated: no safetensors weights, and config.json lacks "
                "hidden_size/num_hidden_layers/vocab_size/num_attention_heads",
                "memory",
                NOTE,
            )
        ]
    workers = spec.scaling.worker_range[0]
    est = memory.estimate(spec, facts, workers)
    budget = spec.scaling.accelerator_memory_gb
    head = (
        f"≈ {memory.size(est.total)} per device at {workers} worker(s) ({spec.training.strategy}, "
        f"{spec.training.finetune}, {memory.compute_bytes(spec) * 8}-bit compute; parameters from {facts.source})"
    )
    if budget is None:
        unchecked = "; set scaling.accelerator_memory_gb to check it" if spec.scaling.use_gpu else ""
        return [Problem("scaling.accelerator_memory_gb", "", f"{head}: {est.arithmetic()}{unchecked}", "memory", NOTE)]
    if est.total <= budget * memory.GiB:
        return [
            Problem("scaling.accelerator_memory_gb", f"{budget:g}", f"fits: {head}: {est.arithmetic()}", "memory", NOTE)
        ]
    fix = memory.smallest_fix(spec, facts, budget * memory.GiB)
    advice = (
        f"smallest change that fits: {fix[0]} (≈ {memory.size(fix[1].total)})"
        if fix
        else "nothing raytrain can change makes it fit: use accelerators with more memory"
    )
    return [
        Problem(
            "scaling.accelerator_memory_gb",
            f"{budget:g}",
            f"does not fit: {head}, more than {budget:g} GiB: {est.arithmetic()}; {advice}",
            "memory",
        )
    ]
