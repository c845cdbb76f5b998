"""Preference training (DPO, SimPO): the rows, the losses against TRL's own code, and the
runs a user relies on (learning, parity across strategies, exact resume, the export).

TRL is a test-only dependency: its DPOTrainer computes the loss and the metrics on the same
model and the same pairs, through its own fused log-prob head, and we compare."""

from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from raytrain.config import DataSpec, JobSpec
from raytrain.data import IGNORE
from raytrain.data.batches import micro_batches
from raytrain.data.pairs import encode_pair
from raytrain.objectives import Preference, sequence_logps


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
    store = SimpleNamespace(seq_len=seq_len, planes=6, manifest={"pad_id": 0}, read=lambda idx: __import__(
        "numpy").stack(planes, axis=1)[idx])
    return micro_batches([store], [(0, i) for i in range(len(rows))], 1)[0]


class _OneProcess:
    """What raytrain's objectives need of a strategy, for one process and one plain model."""

    def __init__(self, model, reference):
        self.model, self.device, self._reference = model, torch.device("cpu"), reference

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
    for i, row in enumerate(mb["position_ids"]):  # right padding: the sequence, then the pad "document"
        attention[i, : int((row == 0).nonzero()[1]) if (row == 0).sum() > 1 else len(row)] = 1
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
    spec = JobSpec.model_validate({"name": "t", "model": {"path": "m"}, "data": {"path": "x"},
                                   "training": {"objective": "dpo", "global_batch_size": 6,
                                                "preference": {"loss": loss_type, "beta": 0.3}}})
    objective = Preference(spec)
    ours, stats = objective(_OneProcess(model, reference), mb)
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
    sums, counts = sequence_logps(logits, labels)
    assert torch.allclose(sums, CPOTrainer.get_batch_logps(logits, labels), atol=1e-5)
    assert counts.tolist() == [6, 6, 6]


def test_dpo_at_the_reference_is_ln2_with_zero_rewards(assets, tok):
    from transformers import AutoModelForCausalLM

    from raytrain.demo_assets import preference_rows

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    mb = _batch(tok, preference_rows(4))
    spec = JobSpec.model_validate({"name": "t", "model": {"path": "m"}, "data": {"path": "x"},
                                   "training": {"objective": "dpo", "global_batch_size": 4}})
    objective = Preference(spec)
    loss, stats = objective(_OneProcess(model, model), mb)
    assert float(loss) / 4 == pytest.approx(math.log(2), abs=1e-7)
    assert [float(s) for s in stats[:4]] == [0.0, 0.0, 0.0, 0.0]
