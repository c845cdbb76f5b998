"""Mixture-of-experts models and each class's own attention (issue #63), against the references that exist:
transformers' own models, `load_balancing_loss_func` and flags, peft's own config and merge.

The families are tests/families.py's tiny Qwen3-MoE (4 experts, 2 a token, fused expert weights in the
model, one weight an expert in its files, as the hub holds them) and gpt-oss (biased, transposed
experts, a biased router, attention sinks, a window on every other layer). The whole-job parity of
every strategy and the resume are the combination test's (tests/test_combinations.py), where these
families take cases; here what it cannot see: the pieces, one process or two."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import families
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import local_run  # noqa: E402

from raytrain.job import implementations  # noqa: E402
from raytrain.job.implementations import AttentionFlags, attention_problem, choose_attention  # noqa: E402
from raytrain.job.spec import JobSpec  # noqa: E402
from raytrain.model import moe, targets  # noqa: E402
from raytrain.model.facts import layout_from_config, read_facts, read_safetensors_header  # noqa: E402

MOE = ("qwen3-moe", "gpt-oss")


@pytest.fixture(scope="module")
def models(assets, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("moe")
    return {f: str(families.build(f, assets, tmp / f.replace(" ", "-"))) for f in families.FAMILIES}


def spec_of(path: str, **training) -> JobSpec:
    lora = training.pop("lora", {})
    return JobSpec.model_validate(
        {
            "name": "moe",
            "model": {"path": path, **training.pop("model", {})},
            "data": {"path": "unused.jsonl", "seq_len": 32},
            "training": {"lora": {"rank": 4, "alpha": 8, **lora}, "precision": "fp32", **training},
            "scaling": {"num_workers": 2},
            "checkpoint": {"storage_path": "/tmp/unused"},
        }
    )


# ---------------------------------------------------------------- attention, from the class's own flags
def test_the_attention_flags_read_from_source_are_the_classes_own(models):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from raytrain import private_apis

    for family, path in models.items():
        config = AutoConfig.from_pretrained(path)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        own = private_apis.attention_flags(cls)
        assert private_apis.attention_flags_from_source(config.model_type, cls.__name__) == own, family
        assert implementations.source_flags(config.to_dict()) == AttentionFlags.of(cls.__name__, own), family
        assert (family in families.NO_SDPA) == (not own["_supports_sdpa"]), family


def test_auto_picks_what_the_class_runs_on_each_device():
    llama = AttentionFlags("LlamaForCausalLM", sdpa=True, flash=True, compatible_flash=None)
    sinks = AttentionFlags("GptOssForCausalLM", sdpa=False, flash=True, compatible_flash=("flash_attention_4",))
    flash_only = AttentionFlags("X", sdpa=False, flash=True, compatible_flash=None)
    # CPU workers and GPU ones alike (torch's varlen kernel makes sdpa flash on a GPU, kernels.py)
    assert [choose_attention(llama, d, b)[0] for d, b in (("cpu", False), ("cuda", True))] == ["sdpa", "sdpa"]
    assert [choose_attention(sinks, d, b)[0] for d, b in (("cpu", False), ("cuda", True))] == ["eager", "eager"]
    assert [choose_attention(flash_only, d, b)[0] for d, b in (("cpu", False), ("cuda", True), ("cuda", False))] == [
        "eager",
        "flash_attention_2",
        "eager",
    ]
    why = attention_problem(sinks, "sdpa")
    assert "GptOssForCausalLM does not support sdpa" in why and "use model.attn_implementation: auto" in why
    assert "runs only its own flash kernels (flash_attention_4)" in attention_problem(sinks, "flash_attention_2")
    assert attention_problem(sinks, "eager") is None and attention_problem(llama, "sdpa") is None


# ---------------------------------------------------------------- the model's layout, from its files
def test_the_facts_hold_the_fused_experts_as_transformers_builds_them(models):
    from transformers import AutoModelForCausalLM

    for family in MOE:
        facts = read_facts(Path(models[family]))
        model = AutoModelForCausalLM.from_pretrained(models[family])
        assert facts.shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}, family
        assert moe.is_moe(facts.config) and moe.experts(facts.config) == 4 and moe.top_k(facts.config) == 2
    # Qwen3-MoE's files hold one weight an expert (the hub's layout), gpt-oss's the fused ones; config.json
    # alone lays out the same Qwen3-MoE
    files = {f: read_safetensors_header(Path(models[f], "model.safetensors")) for f in MOE}
    assert moe.fused_in_files(files["qwen3-moe"]) and not moe.fused_in_files(files["gpt-oss"])
    qwen = read_facts(Path(models["qwen3-moe"]))
    assert layout_from_config(qwen.config) == qwen.shapes
    assert not moe.is_moe(read_facts(Path(models["qwen3 tied"])).config)


# ---------------------------------------------------------------- LoRA on the experts, and what peft does itself
@pytest.mark.parametrize(
    "family,lora",
    [
        ("qwen3-moe", {}),  # the default: attention and experts
        ("gpt-oss", {}),
        ("qwen3-moe", {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj", "gate"]}),  # peft rewrites
        ("qwen3-moe", {"experts": False}),
        ("gpt-oss", {"target_parameters": ["experts.down_proj", "router.weight"]}),
    ],
)
def test_validate_predicts_what_peft_builds(models, family, lora):
    """validate's audit (targets.decide on the facts, peft's rewrite predicted) is the workers' (read from
    what peft built), and the adapted experts' factors are peft's rank per expert."""
    from raytrain.model import modeling
    from raytrain.validate import memory

    spec = spec_of(models[family], lora=lora)
    facts = read_facts(Path(models[family]))
    predicted = targets.audit(memory.lora_counts(spec, facts), facts.shapes, full=False)
    built = modeling.load_model(spec)
    assert modeling.audit(built, full=False) == predicted
    assert sum(p.numel() for p in built.parameters() if p.requires_grad) == memory.trainable_params(spec, facts)
    expert_keys = [n for n, p in built.named_parameters() if p.requires_grad and ".experts." in n]
    assert bool(expert_keys) == lora.get("experts", True), expert_keys
    if "gate" in lora.get("target_modules", []):  # peft's own: the router adapted, gate_up_proj at twice the rank
        assert "router LoRA weight r=4" in predicted and "gate_up_proj r=8 x 4 experts" in predicted
    print(f"\n[audit] {family} {lora}: {predicted}")


def saved_for_backward(model, ids) -> int:
    """Bytes autograd keeps for the backward of one forward, parameters left out."""
    saved, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(v for k, v in saved.items() if k not in params)


@pytest.mark.parametrize("family", MOE)
def test_the_estimate_holds_the_merged_expert_weights_the_backward_keeps(models, family):
    """peft's ParamWrapper adds each expert's B·A to its whole weight at every forward, and autograd keeps
    the sum: what validate's estimate counts for it is what the experts' adapters add to a forward's
    saved tensors (the same job with the experts frozen is the baseline), within 10%."""
    from raytrain.model import modeling
    from raytrain.validate import memory

    facts, ids = read_facts(Path(models[family])), torch.randint(0, 100, (1, 32))
    kept = {}
    for experts in (True, False):
        spec = spec_of(models[family], lora={"experts": experts})
        kept[experts] = saved_for_backward(modeling.load_model(spec), ids)
    [term] = memory.merged_expert_terms(spec_of(models[family]), facts, facts.config["num_hidden_layers"], 4)
    assert term.bytes == pytest.approx(kept[True] - kept[False], rel=0.1), (term, kept)
    assert not memory.merged_expert_terms(spec_of(models[family], lora={"experts": False}), facts, 2, 4)


def test_a_target_matching_nothing_and_options_peft_refuses_are_named(models):
    facts = read_facts(Path(models["qwen3-moe"]))

    def problems(**lora):
        spec = spec_of(models["qwen3-moe"], **lora)
        chosen = targets.decide(spec, facts.modules, facts.shapes, facts.config)
        return targets.unmatched(chosen, facts.modules, facts.shapes), targets.expert_problems(
            spec, chosen, facts.shapes
        )

    assert problems(lora={"target_parameters": ["experts.w9"]})[0] == ["experts.w9"]
    fields = {f for f, _, _ in problems(lora={"dropout": 0.1, "use_dora": True})[1]}
    assert fields == {"training.lora.dropout", "training.lora.use_dora"}
    assert problems(finetune="qlora")[1] == []  # NF4 attention, the experts adapted as loaded (test_combinations)
    (frozen,) = problems(lora={"experts": False, "target_modules": ["q_proj", "down_proj"]})[1]
    assert frozen[0] == "training.lora.experts" and "peft 0.21 turns target_modules down_proj" in frozen[2]
    assert problems(lora={"experts": False, "dropout": 0.1}) == ([], [])  # no parameter adapted: peft's Linear
    # the prediction of peft's rewrite is peft's own table
    from peft.utils import transformers_weight_conversion as peft_conversion

    assert targets.PEFT_REWRITES == peft_conversion._MOE_TARGET_MODULE_MAPPING
    assert {k: tuple(v["gate_up_proj"]) for k, v in peft_conversion._MOE_FUSED_TARGETS.items()} == targets.PEFT_FUSED
    peft_families = {t: f for t, f in peft_conversion._MODEL_TO_CONVERSION_PATTERN.items() if f in targets.PEFT_FUSED}
    assert {t: f for t, f in peft_families.items() if t.islower()} | {f: f for f in targets.PEFT_FUSED} == (
        targets.PEFT_FAMILIES
    )


# ---------------------------------------------------------------- the experts' kernel
def test_every_experts_implementation_gives_eagers_losses_and_gradients(models):
    from transformers import AutoModelForCausalLM

    from raytrain.model import modeling

    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    for family in MOE:
        out = {}
        for kernel in ("eager", "batched_mm", "grouped_mm"):
            spec = spec_of(models[family])
            torch.manual_seed(0)
            model = modeling.apply_lora(
                spec, AutoModelForCausalLM.from_pretrained(models[family], experts_implementation=kernel)
            )
            for n, p in model.named_parameters():  # the adapters away from their zero-effect init
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            out[kernel] = [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]
        for kernel in ("batched_mm", "grouped_mm"):
            for a, b in zip(out[kernel], out["eager"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert implementations.choose_experts("cpu") == implementations.choose_experts("cuda") == "grouped_mm"


# ---------------------------------------------------------------- the router's balancing loss
def test_the_balancing_loss_is_transformers_own_on_each_sequence(models):
    from transformers import AutoModelForCausalLM

    from raytrain.objectives import router

    for family in MOE:
        model = AutoModelForCausalLM.from_pretrained(models[family]).eval()
        ids = torch.randint(3, 300, (3, 20), generator=torch.Generator().manual_seed(2))
        labels = ids.clone()
        ids[0, 14:], labels[0, 14:] = 0, -100  # right padding (pad id 0): never a real token
        ids[2, 17:], labels[2, 17:] = 0, -100
        real = router.real_tokens(ids, labels, pad_id=0)
        assert real.sum(-1).tolist() == [14, 20, 17]
        with torch.no_grad():
            logits = model(input_ids=ids, output_router_logits=True).router_logits
        lb = router.load_balancing(model)
        mine = router.balance_sum(logits, real.float(), real.sum(-1).float(), top_k=2)
        rows = []
        for r in range(3):
            one = tuple(layer.view(3, 20, -1)[r].reshape(20, -1) for layer in logits)
            rows.append(float(lb(one, 4, 2, real[r : r + 1].long())))
            # a micro-batch of one row: transformers' own forward, given the mask, says the same
            with torch.no_grad():
                hf = model(input_ids=ids[r : r + 1], attention_mask=real[r : r + 1].long(), output_router_logits=True)
            assert abs(float(hf.aux_loss) - rows[-1]) < 1e-5, (family, r)
        weighted = sum(t * a for t, a in zip([14, 20, 17], rows)) / 51
        assert abs(float(mine) / 51 - weighted) < 1e-6, family


def _trained(rank: int, world: int, device, cases: list[str], export_root: str) -> dict:
    """Per case (a job's JSON, with its micro-batch size): losses, grad norms, the step's metric means."""
    import mesh_cases

    out = {}
    for text in cases:
        spec = JobSpec.model_validate(json.loads(text))
        rows = mesh_cases.global_rows(False, False, 4, seq=32)
        export = f"{export_root}/{abs(hash(text)) % 10**8}" if spec.training.adapters else None
        result = mesh_cases.run_case(spec, rows, steps=2, export_to=export, resume=True)
        out[text] = {k: result[k] for k in ("losses", "grad_norms", "means", "continued", "resumed")}
        out[text]["export"] = export
    return out


def test_moe_jobs_train_alike_on_any_layout_and_their_adapters_load_in_plain_peft(models, tmp_path):
    """Two gloo ranks: fsdp2 and zero3 LoRA with the experts adapted against DDP, the balancing loss on (the
    config's 0.001) at another micro-batch split; coef 0 against transformers' own loss; every adapter holds
    expert weights, loads with plain peft, and its merge gives its logits; each resumes to the same next step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def job(family, strategy, finetune, micro=1, coef=None):
        return json.dumps(
            {
                "name": "moe",
                "model": {"path": models[family]},
                "data": {"path": "unused.jsonl", "seq_len": 32},
                "training": {
                    "strategy": strategy,
                    "finetune": finetune,
                    "global_batch_size": 4,
                    "micro_batch_size": micro,
                    "max_steps": 3,
                    "precision": "fp32",
                    "router_aux_loss_coef": coef,
                    "lora": {"rank": 4, "alpha": 8},
                },
                "optimizer": {"lr": 1e-2, "schedule": "constant"},
                "scaling": {"num_workers": 2},
                "checkpoint": {"storage_path": str(tmp_path / "runs")},
            }
        )

    cases = {
        ("qwen3-moe", "ddp", "lora"): job("qwen3-moe", "ddp", "lora"),
        ("qwen3-moe", "fsdp2", "lora"): job("qwen3-moe", "fsdp2", "lora", micro=2),
        ("qwen3-moe", "ddp", "full", 0): job("qwen3-moe", "ddp", "full", coef=0),
        ("gpt-oss", "ddp", "lora"): job("gpt-oss", "ddp", "lora"),
        ("gpt-oss", "zero3", "lora"): job("gpt-oss", "zero3", "lora", micro=2),
    }
    got = local_run.spawn(_trained, 2, torch.device("cpu"), list(cases.values()), str(tmp_path / "exports"))
    r = {k: got[v] for k, v in cases.items()}
    for a, b in [
        (("qwen3-moe", "fsdp2", "lora"), ("qwen3-moe", "ddp", "lora")),
        (("gpt-oss", "zero3", "lora"), ("gpt-oss", "ddp", "lora")),
    ]:
        for key in ("losses", "grad_norms", "means"):  # means: the balancing loss, the same at any split
            torch.testing.assert_close(torch.tensor(r[a][key]), torch.tensor(r[b][key]), rtol=1e-5, atol=1e-7)
    for case in r.values():
        assert case["resumed"] == case["continued"]
    assert len(r[("qwen3-moe", "ddp", "lora")]["means"]) == 1 and 1.5 < r[("qwen3-moe", "ddp", "lora")]["means"][0] < 4
    # coef 0 is today's loss: no aux_loss, and transformers' own mean cross-entropy over the same rows
    off = r[("qwen3-moe", "ddp", "full", 0)]
    assert off["means"] == []
    import mesh_cases

    rows = torch.from_numpy(mesh_cases.global_rows(False, False, 4, seq=32)).long()
    base = AutoModelForCausalLM.from_pretrained(models["qwen3-moe"])
    with torch.no_grad():
        hf = base(input_ids=rows[:, 0], position_ids=rows[:, 2], labels=rows[:, 1]).loss
    assert off["losses"][0] == pytest.approx(float(hf), rel=1e-5)

    probe = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    for key, case in r.items():
        if case["export"] is None:
            continue
        family = key[0]
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models[family]), case["export"])
        saved = json.loads(Path(case["export"], "adapter_config.json").read_text())
        assert saved["target_parameters"], saved
        assert any(".experts." in n for n, _ in adapter.named_parameters() if "lora_" in n)
        with torch.no_grad():
            want = adapter(input_ids=probe).logits
            merged = adapter.merge_and_unload()(input_ids=probe).logits
            plain = AutoModelForCausalLM.from_pretrained(models[family])(input_ids=probe).logits
        torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(want, plain)  # trained: the experts' adapters moved


def test_validate_refuses_what_an_moe_or_a_class_cannot_run(models, tmp_path, assets):
    from raytrain.validate import preflight

    def check(family, **over):
        job = {
            "name": "v",
            "model": {"path": models[family], **over.pop("model", {})},
            "data": {"path": str(assets / "text.jsonl"), "seq_len": 32},
            "training": {"lora": {"rank": 4}, **over},
            "scaling": {"num_workers": 2},
            "checkpoint": {"storage_path": str(tmp_path / "runs")},
            "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"},
        }
        path = tmp_path / "job.yaml"
        path.write_text(json.dumps(job))
        report = preflight.check(str(path))
        return {p.field: p.message for p in report.errors}, {p.field: p.message for p in report.notes}

    errors, notes = check("gpt-oss", model={"attn_implementation": "sdpa"})
    assert "GptOssForCausalLM does not support sdpa" in errors["model.attn_implementation"]
    errors, notes = check("gpt-oss")
    assert not errors and notes["model.attn_implementation"].startswith("eager (auto: GptOssForCausalLM supports")
    assert "experts LoRA down_proj r=4 x 4 experts, gate_up_proj r=4 x 4 experts" in notes["training.lora"]
    errors, _ = check("qwen3 tied", router_aux_loss_coef=0.01)
    assert "qwen3 is not a mixture of experts" in errors["training.router_aux_loss_coef"]
    errors, _ = check("qwen3-moe", lora={"rank": 4, "target_parameters": ["experts.w9"]})
    assert "no parameter 'experts.w9'" in errors["training.lora.target_parameters"]
    assert "its 3-D (expert) parameters: down_proj, gate_up_proj" in errors["training.lora.target_parameters"]
    errors, _ = check("qwen3-moe", lora={"rank": 4, "dropout": 0.1})
    assert "training.lora.dropout: 0" in errors["training.lora.dropout"]
    # GRPO's rollouts on vLLM: refused for a mixture of experts, with the reason (the tiny one's head size too)
    grpo = {
        "objective": "grpo",
        "grpo": {
            "num_generations": 2,
            "max_completion_length": 8,
            "engine": "vllm",
            "rewards": [{"function": "raytrain.demo_assets:lipogram"}],
        },
    }
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "the red fox"}) + "\n")
    job = {
        "name": "v",
        "model": {"path": models["qwen3-moe"]},
        "data": {"path": str(path), "seq_len": 32, "format": "prompt"},
        "training": {"lora": {"rank": 4}, **grpo},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"},
    }
    (tmp_path / "grpo.yaml").write_text(json.dumps(job))
    engine = [
        p.message for p in preflight.check(str(tmp_path / "grpo.yaml")).errors if p.field == "training.grpo.engine"
    ]
    assert any("a mixture of experts: its experts' LoRA adapters" in m and "use engine: hf" in m for m in engine)
    assert any("vLLM's CPU attention takes head sizes" in m for m in engine), engine


@pytest.mark.slow
def test_a_gpt_oss_full_fine_tune_trains_at_the_default_attention_and_logs_its_balancing_loss(
    ray_address, assets, models, tmp_path
):
    """The whole job on Ray (2 workers, fsdp2): gpt-oss at `attn_implementation: auto` (eager: no sdpa for its
    sinks) trains; MLflow has aux_loss every step, the kernel line names the choices, the audit every group."""
    from conftest import make_job, metric_history
    from mlflow.tracking import MlflowClient

    from raytrain.driver import launcher
    from raytrain.tracking.mlflow_run import tracking_uri

    spec = make_job(
        assets,
        tmp_path / "runs",
        model={"path": models["gpt-oss"]},
        training={"finetune": "full", "max_steps": 6},
        optimizer={"lr": 3e-3, "warmup_steps": 0},
        checkpoint={"every_n_steps": 6, "export_final": False},
    )
    assert spec.model.attn_implementation == "auto"
    result = launcher.run(spec)
    losses, aux = metric_history(spec, result.run_id), metric_history(spec, result.run_id, "aux_loss")
    assert sorted(aux) == list(range(1, 7)) and all(1.0 < v < 4.0 for v in aux.values()), aux  # E·Σ f·P, k=2
    assert losses[6] < losses[1], losses
    tags = MlflowClient(tracking_uri(spec)).get_run(result.run_id).data.tags
    assert tags["raytrain.kernels"].startswith("attention eager (auto: GptOssForCausalLM supports eager here")
    assert tags["raytrain.kernels"].endswith(", experts grouped_mm"), tags["raytrain.kernels"]
    assert tags["raytrain.adapters"].startswith("attention trained") and "experts trained" in tags["raytrain.adapters"]
