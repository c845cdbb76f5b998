"""Preference training (DPO, SimPO): the rows, the losses against TRL's own code, and the
runs a user relies on (learning, parity across strategies, exact resume, the export).

TRL is a test-only dependency: its DPOTrainer computes the loss and the metrics on the same
model and the same pairs, through its own fused log-prob head, and we compare."""

from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raytrain.config import DataSpec, JobSpec
from raytrain.data import IGNORE
from raytrain.data.batches import micro_batches
from raytrain.data.pairs import encode_pair
from raytrain.objectives import Preference, sequence_logps, targets_of


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets / "model"))


def trained_text(tok, sequence) -> str:
    ids, labels = sequence
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE])


# ---------------------------------------------------------------- rows
@pytest.mark.parametrize("fmt, row", [
    ("text", {"prompt": "the red fox", "chosen": " jumps over the hill.", "rejected": " runs over the hill."}),
    ("chat", {"prompt": [{"role": "user", "content": "what does the fox do?"}],
              "chosen": [{"role": "assistant", "content": "jumps over the hill."}],
              "rejected": {"role": "assistant", "content": "runs over the hill."}}),
    ("alpaca", {"instruction": "what does the fox do?", "input": "", "chosen": "jumps over the hill.",
                "rejected": "runs over the hill."}),
    ("sharegpt", {"conversations": [{"from": "human", "value": "what does the fox do?"}],
                  "chosen": {"from": "gpt", "value": "jumps over the hill."},
                  "rejected": {"from": "gpt", "value": "runs over the hill."}}),
])
def test_each_format_labels_only_the_responses_after_a_shared_prompt(tok, fmt, row):
    chosen, rejected = encode_pair(tok, DataSpec(path="x", format=fmt, seq_len=64), json.dumps(row).encode())
    closer = tok.eos_token if fmt == "text" else "<|im_end|>"
    assert trained_text(tok, chosen) == f"{' ' if fmt == 'text' else ''}jumps over the hill.{closer}"
    assert trained_text(tok, rejected) == f"{' ' if fmt == 'text' else ''}runs over the hill.{closer}"
    def prompt(sequence):  # the tokens before the first trained one
        ids, labels = sequence
        return ids[:next(i for i, label in enumerate(labels) if label != IGNORE)]

    assert len(prompt(chosen)) > 2 and prompt(chosen) == prompt(rejected)  # never trained, the same


def test_the_implicit_prompt_shape_splits_at_the_shared_turns(tok):
    user = {"role": "user", "content": "what does the fox do?"}
    row = {"chosen": [user, {"role": "assistant", "content": "it jumps."}],
           "rejected": [user, {"role": "assistant", "content": "it runs."}]}
    chosen, rejected = encode_pair(tok, DataSpec(path="x", format="chat", seq_len=64), row)
    assert (trained_text(tok, chosen), trained_text(tok, rejected)) == ("it jumps.<|im_end|>", "it runs.<|im_end|>")
    assert chosen[1].index(next(x for x in chosen[1] if x != IGNORE)) > 5  # the user turn is the prompt


def test_earlier_assistant_turns_of_the_prompt_are_context_not_trained(tok):
    row = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the owl flies."},
                      {"role": "user", "content": "and the fox?"}], "chosen": "the fox jumps.", "rejected": "it runs."}
    chosen, _ = encode_pair(tok, DataSpec(path="x", format="chat", seq_len=96), row)
    assert trained_text(tok, chosen) == "the fox jumps.<|im_end|>"


@pytest.mark.parametrize("row, why", [
    ({"prompt": "the fox", "chosen": " jumps."}, "no 'rejected' column"),
    ({"prompt": "the fox", "chosen": " jumps.", "rejected": ""}, "'rejected' must be a non-empty string"),
    ({"prompt": "the fox " * 40, "chosen": " jumps.", "rejected": " runs."}, "longer than data.seq_len=32"),
])
def test_a_pair_that_cannot_be_compared_is_a_bad_row_with_the_reason(tok, row, why):
    with pytest.raises(ValueError, match=why):
        encode_pair(tok, DataSpec(path="x", format="text", seq_len=32), row)


# ---------------------------------------------------------------- losses, against TRL
def _batch(tok, rows: list[dict], seq_len: int = 32) -> dict:
    """The micro-batch raytrain's store gives for these pairs: chosen rows, then rejected rows."""
    from raytrain.data.records import pad_rows

    pairs = [encode_pair(tok, DataSpec(path="x", format="text", seq_len=seq_len), r) for r in rows]
    planes = [*pad_rows([c for c, _ in pairs], seq_len, 0), *pad_rows([r for _, r in pairs], seq_len, 0)]
    rows = np.stack(planes, axis=1)
    store = SimpleNamespace(seq_len=seq_len, planes=6, manifest={"pad_id": 0}, read=lambda idx: rows[idx])
    return micro_batches([store], [(0, i) for i in range(len(rows))], 1)[0]


class _OneProcess:
    """What raytrain's objectives need of a strategy, for one process and one plain model: copies of
    the models with raytrain's attention (as `modeling.load_model` gives the strategies), the job's
    implementation inside; the originals stay plain transformers models for TRL."""

    def __init__(self, model, reference, spec):
        import copy

        from raytrain import attention

        copies = {id(m): copy.deepcopy(m) for m in (model, reference) if m is not None}
        for m in copies.values():
            attention.install(m, spec.model.attn_implementation)
        self.model, self._reference = copies[id(model)], copies.get(id(reference))
        self.spec, self.device, self.compute_bf16, self.attention_windows = spec, torch.device("cpu"), False, (None,)
        self.loss_chunk = 0  # the whole logits at once (training.chunked_loss has its own test)
        self.sequence = None  # whole sequences (sequence parallelism: tests/test_combinations.py)

    def autocast(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def reference(self):
        yield self._reference


def _trl_dpo(model, reference, mb: dict, loss_type: str, beta: float) -> tuple[float, dict]:
    """TRL's DPOTrainer._compute_loss on the same pairs, one process (its gathers are the identity)."""
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    for m in (model, reference):
        if not getattr(m, "_fused", False):
            add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
            m._fused = True
    ids, labels = mb["input_ids"], mb["labels"]
    completion = (labels != IGNORE).long()
    attention = torch.zeros_like(ids)
    for i, row in enumerate(completion):  # right padding: the prompt and its response, then padding
        attention[i, : int(row.nonzero()[-1]) + 1] = 1
    identity = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=model, ref_model=reference, accelerator=identity, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                              loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                              use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_and_metrics_equal_trls_on_the_same_model_and_pairs(assets, tok, loss_type):
    from transformers import AutoModelForCausalLM

    from raytrain.demo_assets import preference_rows

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"), attn_implementation="eager").train()
    reference = AutoModelForCausalLM.from_pretrained(str(assets / "model"), attn_implementation="eager").eval()
    torch.manual_seed(1)
    with torch.no_grad():  # the policy moved away from the reference, as after some training
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mb = _batch(tok, preference_rows(6, seed=3))
    spec = JobSpec.model_validate({"name": "t", "model": {"path": "m", "attn_implementation": "eager"},
                                   "data": {"path": "x"}, "training": {"objective": "dpo", "global_batch_size": 6,
                                                                       "preference": {"loss": loss_type, "beta": 0.3}}})
    objective = Preference(spec)
    ours, stats = objective(_OneProcess(model, reference, spec), mb)
    n = objective.units(mb)
    mine = {name: float(s) / n for name, s in zip(objective.metrics, stats)}
    theirs_loss, theirs = _trl_dpo(model, reference, mb, loss_type, beta=0.3)
    assert n == 6 and float(ours) / n == pytest.approx(theirs_loss, abs=1e-6)
    for name in objective.metrics:
        assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    assert 0 < mine["rewards/accuracies"] < 1  # a batch where the comparison is not trivial


def test_simpo_loss_equals_trls_cpo_simpo_and_logps_equal_trls():
    from trl.experimental.cpo import CPOTrainer

    from raytrain.objectives import pair_losses

    g = torch.Generator().manual_seed(0)
    chosen, rejected = -torch.rand(8, generator=g) * 40, -torch.rand(8, generator=g) * 40
    n_c, n_r = torch.randint(3, 20, (8,), generator=g), torch.randint(3, 20, (8,), generator=g)
    for smoothing in (0.0, 0.1):
        p = JobSpec.model_validate({"name": "t", "model": {"path": "m"}, "data": {"path": "x"}, "training": {
            "objective": "simpo", "preference": {"beta": 2.0, "gamma": 0.7, "label_smoothing": smoothing}}}).training.preference
        ours, reward_c, reward_r = pair_losses("simpo", p, chosen, rejected, None, None, n_c, n_r)
        cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=smoothing,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
        theirs, their_c, their_r = CPOTrainer.cpo_loss(cpo, chosen / n_c, rejected / n_r)
        assert torch.allclose(ours, theirs, atol=1e-6)
        assert torch.allclose(reward_c, their_c, atol=1e-6) and torch.allclose(reward_r, their_r, atol=1e-6)
    logits, labels = torch.randn(3, 10, 50, generator=g), torch.randint(0, 50, (3, 10), generator=g)
    labels[:, :4] = IGNORE
    sums = sequence_logps(logits, targets_of(labels))
    assert torch.allclose(sums, CPOTrainer.get_batch_logps(logits, labels), atol=1e-5)


def test_dpo_at_the_reference_is_ln2_with_zero_rewards(assets, tok):
    from transformers import AutoModelForCausalLM

    from raytrain.demo_assets import preference_rows

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    mb = _batch(tok, preference_rows(4))
    spec = JobSpec.model_validate({"name": "t", "model": {"path": "m"}, "data": {"path": "x"},
                                   "training": {"objective": "dpo", "global_batch_size": 4}})
    objective = Preference(spec)
    loss, stats = objective(_OneProcess(model, model, spec), mb)
    assert float(loss) / 4 == pytest.approx(math.log(2), abs=1e-7)
    assert [float(s) for s in stats[:4]] == [0.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- runs on the cluster
STEPS, PARITY_STEPS, EVERY = 20, 8, 4
LOSS_REL_TOL = 1e-5


def dpo_job(assets, storage, name, strategy="fsdp2", finetune="lora", objective="dpo", steps=PARITY_STEPS, **over):
    from conftest import make_job

    return make_job(assets, storage, name=name,
                    data={"path": str(assets / "pairs.jsonl"), "seq_len": 16,
                          "eval": {"fraction": 0.05, "every_n_steps": EVERY}},
                    training={"objective": objective, "strategy": strategy, "finetune": finetune, "max_steps": steps},
                    optimizer={"lr": 1e-2 if finetune == "lora" else 1e-3, "warmup_steps": 2, "schedule": "constant"},
                    checkpoint={"every_n_steps": EVERY, "keep_last": 2}, **over)


KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "eval_loss", "eval_rewards/accuracies", "step_time_s")


@pytest.fixture(scope="module")
def runs(ray_address, assets, tmp_path_factory):
    from conftest import metric_history

    from raytrain import launcher

    # DPO's strategy parity is fsdp2 against zero3 (sharded policy and reference both ways); ddp's
    # parity with them is test_strategies.py's, and its reference is a plain unsharded copy. ZeRO-3's
    # LoRA run has 3 workers: 8 pairs a step on 3 ranks is 3, 3 and 2, so one rank runs a padding
    # pair, which must add nothing to the loss or the metrics.
    plan = [("fsdp2", "lora", "dpo", STEPS, 2)] + [(s, f, "dpo", PARITY_STEPS, w) for s, f, w in [
        ("zero3", "lora", 3), ("fsdp2", "full", 2), ("zero3", "full", 2)]] + [("fsdp2", "lora", "simpo", PARITY_STEPS, 2)]
    out = {}
    for strategy, finetune, objective, steps, workers in plan:
        name = f"{objective}-{strategy}-{finetune}-{workers}w"
        spec = dpo_job(assets, tmp_path_factory.mktemp(name), name, strategy, finetune, objective, steps,
                       scaling={"num_workers": workers})
        result = launcher.run(spec)
        out[objective, strategy, finetune] = SimpleNamespace(
            spec=spec, run_id=result.run_id, **{k.replace("/", "_"): metric_history(spec, result.run_id, k) for k in KEYS})
    print("\n[dpo] eval rewards/accuracies, fsdp2 LoRA:", out["dpo", "fsdp2", "lora"].eval_rewards_accuracies)
    return out


@pytest.mark.slow
def test_lora_dpo_starts_at_the_reference_and_learns_the_held_out_preference(runs):
    run = runs["dpo", "fsdp2", "lora"]
    # Step 1: the adapter is zero, so the policy is the reference: ln 2 and every reward 0, exactly.
    assert run.loss[1] == pytest.approx(math.log(2), abs=1e-7)
    assert run.rewards_chosen[1] == run.rewards_rejected[1] == run.rewards_margins[1] == 0.0
    assert run.rewards_accuracies[1] == 0.0  # a tie is not a win (TRL counts chosen > rejected)
    accuracy = run.eval_rewards_accuracies
    assert sorted(accuracy) == [4, 8, 12, 16, 20]
    # Learned by the end; the way there depends on the data order (at lr 1e-2 a step-12 dip to 0.74
    # came with the order of #24, where the older order had crossed 0.9 by then).
    assert accuracy[4] < 0.9 and min(accuracy[16], accuracy[20]) >= 0.9, accuracy
    assert run.eval_loss[20] < run.eval_loss[4] < math.log(2)
    assert run.rewards_margins[20] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_strategies_agree_per_step_on_dpo(runs, finetune):
    # LoRA: fsdp2 on 2 workers against zero3 on 3 (with its padding pair); full: both on 2.
    figures = {}
    fsdp2, zero3 = runs["dpo", "fsdp2", finetune], runs["dpo", "zero3", finetune]
    for key in ("loss", "logps_chosen", "rewards_margins", "rewards_accuracies"):
        x, y = getattr(fsdp2, key), getattr(zero3, key)
        if key in ("rewards_margins", "rewards_accuracies"):  # start at 0: absolute, not relative
            worst = max(abs(x[k] - y[k]) for k in range(1, PARITY_STEPS + 1))
        else:
            worst = max(abs(x[k] - y[k]) / abs(y[k]) for k in range(1, PARITY_STEPS + 1))
        figures[key] = worst
        assert worst <= LOSS_REL_TOL, (key, worst)
    assert zero3.eval_loss[EVERY] == pytest.approx(fsdp2.eval_loss[EVERY], rel=LOSS_REL_TOL)
    print(f"\n[dpo parity] fsdp2-zero3 {finetune}: {json.dumps(figures, indent=1)}")
    # Each trains: the full fine-tune's own reference copy is left behind by its policy.
    assert fsdp2.loss[PARITY_STEPS] < math.log(2) - 0.01 and fsdp2.rewards_margins[PARITY_STEPS] > 0


@pytest.mark.slow
def test_simpo_trains_without_a_reference(runs):
    run = runs["simpo", "fsdp2", "lora"]
    assert run.loss[PARITY_STEPS] < run.loss[1]
    assert run.rewards_margins[PARITY_STEPS] > run.rewards_margins[1]
    assert run.rewards_chosen[1] != 0.0  # beta x the average log-prob, not a log-ratio


@pytest.mark.slow
def test_full_dpo_continued_from_its_checkpoint_takes_the_same_steps(runs, assets, tmp_path):
    # The fsdp2 full run's directory without its last checkpoint (deleted, as a user deletes a
    # folder), continued: the policy, its AdamW state and the frozen reference copy come back,
    # and steps 5-8 and their evals are the uninterrupted run's, bit for bit.
    from conftest import metric_history, without_checkpoint

    from raytrain import launcher

    reference = runs["dpo", "fsdp2", "full"]
    with without_checkpoint(reference.spec.run_dir, PARITY_STEPS) as storage:
        spec = dpo_job(assets, storage, reference.spec.name, "fsdp2", "full")
        result = launcher.run(spec)
    assert result.goodput["failures"] == []
    for key in ("loss", "rewards/margins", "eval_rewards/accuracies"):
        assert metric_history(spec, result.run_id, key) == getattr(reference, key.replace("/", "_")), key


@pytest.mark.slow
def test_exported_adapter_loads_with_plain_peft_and_gives_the_last_eval(runs, tok):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain.data.order import HeldOut
    from raytrain.data.store import TokenStore

    run = runs["dpo", "fsdp2", "lora"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run.spec.model.path),
                                      f"{run.spec.run_dir}/final_model").eval()
    [store_dir] = [p for p in (Path(run.spec.checkpoint.storage_path) / "datasets").iterdir()]
    store = TokenStore.open(str(store_dir))
    split = HeldOut(store.rows, 0.05)  # under data.eval.max_rows: every held-out row is evaluated
    rows = store.read(split.held_rows(np.arange(split.held)))
    t = torch.from_numpy(rows).long()
    t = torch.cat([t[:, :3], t[:, 3:]])
    mb = {"input_ids": t[:, 0], "labels": t[:, 1], "position_ids": t[:, 2]}

    class WithAdapterOff(_OneProcess):
        @contextlib.contextmanager
        def reference(self):
            with self.model.disable_adapter():
                yield self.model

    objective = Preference(run.spec)
    with torch.no_grad():
        loss, stats = objective(WithAdapterOff(model, None, run.spec), mb)
    pairs = objective.units(mb)
    assert loss / pairs == pytest.approx(run.eval_loss[STEPS], rel=1e-5)
    accuracy = float(stats[objective.metrics.index("rewards/accuracies")]) / pairs
    assert accuracy == pytest.approx(run.eval_rewards_accuracies[STEPS], abs=1e-9)
