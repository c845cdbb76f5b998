"""Preference training (DPO, SimPO, reward models, KTO): the rows, the losses against TRL's own
code, and the runs a user relies on (learning, the same steps at any worker count, parity across
strategies, the export; exact resume of every objective is test_combinations.py's resume axis).

TRL is a test-only dependency: its DPOTrainer, RewardTrainer and KTOTrainer compute the loss and
the metrics on the same model and the same rows, and we compare."""

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

from raytrain.data import IGNORE
from raytrain.data.batches import micro_batches
from raytrain.data.pairs import encode_pair
from raytrain.job.spec import DataSpec, JobSpec
from raytrain.objectives import Preference, sequence_logps, targets_of


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets / "model"))


def trained_text(tok, sequence) -> str:
    ids, labels = sequence
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE])


# ---------------------------------------------------------------- rows
@pytest.mark.parametrize(
    "fmt, row",
    [
        ("text", {"prompt": "the red fox", "chosen": " jumps over the hill.", "rejected": " runs over the hill."}),
        (
            "chat",
            {
                "prompt": [{"role": "user", "content": "what does the fox do?"}],
                "chosen": [{"role": "assistant", "content": "jumps over the hill."}],
                "rejected": {"role": "assistant", "content": "runs over the hill."},
            },
        ),
        (
            "alpaca",
            {
                "instruction": "what does the fox do?",
                "input": "",
                "chosen": "jumps over the hill.",
                "rejected": "runs over the hill.",
            },
        ),
        (
            "sharegpt",
            {
                "conversations": [{"from": "human", "value": "what does the fox do?"}],
                "chosen": {"from": "gpt", "value": "jumps over the hill."},
                "rejected": {"from": "gpt", "value": "runs over the hill."},
            },
        ),
    ],
)
def test_each_format_labels_only_the_responses_after_a_shared_prompt(tok, fmt, row):
    chosen, rejected = encode_pair(tok, DataSpec(path="x", format=fmt, seq_len=64), json.dumps(row).encode())
    closer = tok.eos_token if fmt == "text" else "<|im_end|>"
    assert trained_text(tok, chosen) == f"{' ' if fmt == 'text' else ''}jumps over the hill.{closer}"
    assert trained_text(tok, rejected) == f"{' ' if fmt == 'text' else ''}runs over the hill.{closer}"

    def prompt(sequence):  # the tokens before the first trained one
        ids, labels = sequence
        return ids[: next(i for i, label in enumerate(labels) if label != IGNORE)]

    assert len(prompt(chosen)) > 2 and prompt(chosen) == prompt(rejected)  # never trained, the same


def test_the_implicit_prompt_shape_splits_at_the_shared_turns(tok):
    user = {"role": "user", "content": "what does the fox do?"}
    row = {
        "chosen": [user, {"role": "assistant", "content": "it jumps."}],
        "rejected": [user, {"role": "assistant", "content": "it runs."}],
    }
    chosen, rejected = encode_pair(tok, DataSpec(path="x", format="chat", seq_len=64), row)
    assert (trained_text(tok, chosen), trained_text(tok, rejected)) == ("it jumps.<|im_end|>", "it runs.<|im_end|>")
    assert chosen[1].index(next(x for x in chosen[1] if x != IGNORE)) > 5  # the user turn is the prompt


def test_earlier_assistant_turns_of_the_prompt_are_context_not_trained(tok):
    row = {
        "prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "the owl flies."},
            {"role": "user", "content": "and the fox?"},
        ],
        "chosen": "the fox jumps.",
        "rejected": "it runs.",
    }
    chosen, _ = encode_pair(tok, DataSpec(path="x", format="chat", seq_len=96), row)
    assert trained_text(tok, chosen) == "the fox jumps.<|im_end|>"


@pytest.mark.parametrize("margin", ["0.5", True, float("nan"), 1e39])
def test_a_reward_rows_margin_that_is_no_number_is_a_bad_row(tok, margin):
    row = {"prompt": "the fox", "chosen": " jumps.", "rejected": " runs.", "margin": margin}
    with pytest.raises(ValueError, match="column 'margin' \\(the pair's margin\\) must be a finite number"):
        encode_pair(tok, DataSpec(path="x", format="text", seq_len=32), row, margins=True)


def test_a_margin_is_stored_as_three_tokens_and_read_back_bit_for_bit():
    from raytrain.data.pairs import MARGIN_TAG_BITS, margin_tag
    from raytrain.objectives.pairs import margins_of

    values = [0.0, -0.0, 0.1, -2.5, 1e-42, 3.4028234663852886e38, -1.5e-38, 7.0]  # a subnormal, float32's max
    tags = [margin_tag(v) for v in values]
    assert all(0 <= t < 2**MARGIN_TAG_BITS for tag in tags for t in tag)
    got = margins_of(torch.tensor([tag + [0] * 5 for tag in tags]))  # a tag sequence padded to its row
    assert got.numpy().tobytes() == np.array(values, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    "row, why",
    [
        ({"prompt": "the fox", "chosen": " jumps."}, "no 'rejected' column"),
        ({"prompt": "the fox", "chosen": " jumps.", "rejected": ""}, "'rejected' must be a non-empty string"),
        ({"prompt": "the fox " * 40, "chosen": " jumps.", "rejected": " runs."}, "longer than data.seq_len=32"),
    ],
)
def test_a_pair_that_cannot_be_compared_is_a_bad_row_with_the_reason(tok, row, why):
    with pytest.raises(ValueError, match=why):
        encode_pair(tok, DataSpec(path="x", format="text", seq_len=32), row)


# ---------------------------------------------------------------- losses, against TRL
def _batch(tok, rows: list[dict], seq_len: int = 32, margins: bool = False) -> dict:
    """The micro-batch raytrain's store gives for these pairs: chosen rows, then rejected rows (then,
    with `margins`, a reward model's margin tags)."""
    from raytrain.data.records import pad_rows

    pairs = [encode_pair(tok, DataSpec(path="x", format="text", seq_len=seq_len), r, margins) for r in rows]
    pad = tok.pad_token_id
    planes = [plane for k in range(len(pairs[0])) for plane in pad_rows([p[k] for p in pairs], seq_len, pad)]
    rows = np.stack(planes, axis=1)
    store = SimpleNamespace(seq_len=seq_len, planes=len(planes), manifest={"pad_id": 0}, read=lambda idx: rows[idx])
    return micro_batches([store], [(0, i) for i in range(len(rows))], 1)[0]


class _OneProcess:
    """What raytrain's objectives need of a strategy, for one process and one plain model: copies of
    the models with raytrain's attention (as `modeling.load_model` gives the strategies), the job's
    implementation inside; the originals stay plain transformers models for TRL."""

    def __init__(self, model, reference, spec, split=None):
        import copy

        from raytrain import private_apis
        from raytrain.job.implementations import AUTO, AttentionFlags, choose_attention
        from raytrain.model import attention

        if spec.model.attn_implementation == AUTO:  # as a CPU worker resolves it: the one rule, on the class's flags
            cls = type(model)
            chosen, _ = choose_attention(
                AttentionFlags.of(cls.__name__, private_apis.attention_flags(cls)), "cpu", False
            )
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"attn_implementation": chosen})})
        copies = {id(m): copy.deepcopy(m) for m in (model, reference) if m is not None}
        for m in copies.values():
            attention.install(m, spec.model.attn_implementation)
        self.model, self._reference = copies[id(model)], copies.get(id(reference))
        self.spec, self.device, self.compute_bf16, self.attention_windows = spec, torch.device("cpu"), False, (None,)
        self.loss_chunk = 0  # the whole logits at once (training.chunked_loss has its own test)
        self.attention_kernel, self.fused_loss = spec.model.attn_implementation, None  # as a CPU worker's
        self.sequence = split  # whole sequences unless a test plays one rank of a sequence-parallel group
        self.router_aux_coef = 0  # dense models: no balancing loss (strategies/base.py resolves it for MoE)

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
    trainer = SimpleNamespace(
        model=model,
        ref_model=reference,
        accelerator=identity,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=False,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
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
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": {"path": "m", "attn_implementation": "eager"},
            "data": {"path": "x"},
            "training": {"objective": "dpo", "global_batch_size": 6, "preference": {"loss": loss_type, "beta": 0.3}},
        }
    )
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
        p = JobSpec.model_validate(
            {
                "name": "t",
                "model": {"path": "m"},
                "data": {"path": "x"},
                "training": {
                    "objective": "simpo",
                    "preference": {"beta": 2.0, "gamma": 0.7, "label_smoothing": smoothing},
                },
            }
        ).training.preference
        ours, reward_c, reward_r = pair_losses("simpo", p, chosen, rejected, None, None, n_c, n_r)
        cpo = SimpleNamespace(
            alpha=0.0,
            loss_type="simpo",
            simpo_gamma=0.7,
            beta=2.0,
            label_smoothing=smoothing,
            accelerator=SimpleNamespace(device=torch.device("cpu")),
        )
        theirs, their_c, their_r = CPOTrainer.cpo_loss(cpo, chosen / n_c, rejected / n_r)
        assert torch.allclose(ours, theirs, atol=1e-6)
        assert torch.allclose(reward_c, their_c, atol=1e-6) and torch.allclose(reward_r, their_r, atol=1e-6)
    logits, labels = torch.randn(3, 10, 50, generator=g), torch.randint(0, 50, (3, 10), generator=g)
    labels[:, :4] = IGNORE
    sums = sequence_logps(logits, targets_of(labels))
    assert torch.allclose(sums, CPOTrainer.get_batch_logps(logits, labels), atol=1e-5)


def _reward_model(assets, tok):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(assets / "model"), num_labels=1, pad_token_id=tok.pad_token_id, attn_implementation="eager"
    ).train()
    torch.manual_seed(2)
    with torch.no_grad():  # a head that scores: the pairs' rewards differ either way
        model.score.weight.normal_(0, 0.5)
    return model


MARGINS = [0.5, -0.25, 1.0, None, 2.0, 0.1]  # TRL's per-row margin; a row without one is margin 0


@pytest.mark.parametrize("center,margins", [(None, False), (0.05, True)])
def test_reward_model_loss_and_metrics_equal_trls(assets, tok, center, margins):
    from trl import RewardTrainer

    from raytrain.demo_assets import preference_rows
    from raytrain.objectives import Reward

    rows = preference_rows(6, seed=5)
    if margins:
        rows = [{**r, **({"margin": m} if m is not None else {})} for r, m in zip(rows, MARGINS)]
    model, mb = _reward_model(assets, tok), _batch(tok, rows, margins=True)
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": {"path": "m", "attn_implementation": "eager"},
            "data": {"path": "x"},
            "training": {
                "objective": "reward",
                "global_batch_size": 6,
                "preference": {"center_rewards_coefficient": center},
            },
        }
    )
    objective = Reward(spec)
    ours, stats = objective(_OneProcess(model, None, spec), mb)
    n = objective.units(mb)
    mine = {name: float(s) / n for name, s in zip(objective.metrics, stats)}
    # TRL's compute_loss on its collator's batch: chosen then rejected, right-padded, with a mask.
    identity = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=model,
        accelerator=identity,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(center_rewards_coefficient=center),
    )
    mask = (mb["input_ids"] != tok.pad_token_id).long()
    inputs = {"input_ids": mb["input_ids"], "attention_mask": mask}
    if margins:  # TRL's collator: a float32 tensor of the rows' margins
        inputs["margin"] = torch.tensor([m or 0.0 for m in MARGINS], dtype=torch.float)
        assert torch.equal(mb["margin"], inputs["margin"])  # stored as tags and read back bit for bit
    theirs = float(RewardTrainer.compute_loss(trainer, model, inputs))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert n == 6 and float(ours) / n == pytest.approx(theirs, rel=1e-6, abs=1e-6)  # (fp32 sums of ~15)
    for name in ("accuracy", "margin", "mean_reward"):
        assert mine[name] == pytest.approx(metrics[name], abs=1e-6), name
    assert 0 < mine["accuracy"] < 1  # a batch where the comparison is not trivial


def test_a_reward_is_read_where_transformers_reads_it_and_by_one_sequence_part(assets, tok):
    # The score is the head's output at the last token that is not padding: the exported model,
    # called as AutoModelForSequenceClassification, gives the same. Under sequence parallelism the
    # rank whose part holds that token scores it and the others add 0 (the real exchange:
    # test_combinations.py); here the two ranks of a group of 2 say which positions they score.
    from raytrain.objectives import score, staged
    from raytrain.objectives.pairs import split_margins

    rows = [
        {"prompt": "the red fox", "chosen": " jumps.", "rejected": " runs over the long green hill and far away."},
        {"prompt": "the cat", "chosen": " sleeps on the warm mat by the door all day.", "rejected": " sits."},
    ]
    model, mb = _reward_model(assets, tok), split_margins(_batch(tok, rows, seq_len=32, margins=True))
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": {"path": "m", "attn_implementation": "eager"},
            "data": {"path": "x"},
            "training": {"objective": "reward", "global_batch_size": 2},
        }
    )
    ours = score(_OneProcess(model, None, spec), model, dict(mb)).detach()
    with torch.no_grad():
        plain = model(input_ids=mb["input_ids"], attention_mask=(mb["input_ids"] != tok.pad_token_id).long()).logits
    assert torch.allclose(ours, plain.squeeze(-1), atol=1e-6)
    last = [max(i for i, t in enumerate(row) if t != tok.pad_token_id) for row in mb["input_ids"].tolist()]
    for rank in (0, 1):
        split = SimpleNamespace(size=2, rank=rank, part=lambda t, r=rank: t[:, r * 16 : (r + 1) * 16])
        x = staged(_OneProcess(model, None, spec, split=split), dict(mb))
        assert x["here"].tolist() == [float(16 * rank <= i < 16 * (rank + 1)) for i in last]
        assert [p for p, h in zip(x["last"].tolist(), x["here"].tolist()) if h] == [
            i - 16 * rank for i in last if 16 * rank <= i < 16 * (rank + 1)
        ]
    assert 0 < sum(i >= 16 for i in last) < 4  # the rows put last tokens in both parts


KTO_ROWS = [
    {"prompt": "the red fox", "completion": " jumps over the hill.", "label": True},
    {"prompt": "the cat", "completion": " sleeps.", "label": False},
    {"prompt": "a small owl", "completion": " flies over the dark woods.", "label": True},
    {"prompt": "the dog", "completion": " barks at the moon all night.", "label": False},
    {"prompt": "the horse", "completion": " runs.", "label": True},
]


def _kto_batch(tok, rows: list[dict], seq_len: int = 32) -> dict:
    """A KTO micro-batch as raytrain's store gives it: each row's example, KL sequence and label tag."""
    from raytrain.data.records import pad_rows
    from raytrain.data.unpaired import encode_unpaired

    encoded = encode_unpaired(tok, DataSpec(path="x", format="text", seq_len=seq_len), [json.dumps(r) for r in rows])
    planes = [plane for q in range(3) for plane in pad_rows([e[q] for e in encoded], seq_len, tok.pad_token_id)]
    stacked = np.stack(planes, axis=1)
    store = SimpleNamespace(
        seq_len=seq_len, planes=9, manifest={"pad_id": tok.pad_token_id}, read=lambda idx: stacked[idx]
    )
    return micro_batches([store], [(0, i) for i in range(len(rows))], 1)[0]


def _trl_kto(
    model, reference, mb: dict, beta: float, weights: tuple[float, float], loss_type: str = "kto"
) -> tuple[float, dict]:
    """TRL's KTOTrainer._compute_loss on the same rows and KL sequences, one process."""
    from trl import KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    for m in (model, reference):
        if not getattr(m, "_fused", False):
            add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
            m._fused = True
    b = len(mb["input_ids"]) // 3
    inputs = {"label": mb["input_ids"][2 * b :, 0].bool()}
    for prefix, rows in (("", slice(0, b)), ("KL_", slice(b, 2 * b))):
        ids, labels = mb["input_ids"][rows], mb["labels"][rows]
        completion = (labels != IGNORE).long()
        attention = torch.zeros_like(ids)
        for i, row in enumerate(completion):  # right padding: the prompt and its completion, then padding
            attention[i, : int(row.nonzero()[-1]) + 1] = 1
        inputs.update(
            {f"{prefix}input_ids": ids, f"{prefix}attention_mask": attention, f"{prefix}completion_mask": completion}
        )
    identity = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t, unwrap_model=lambda m: m
    )
    trainer = SimpleNamespace(
        model=model,
        ref_model=reference,
        accelerator=identity,
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        calculate_KL=loss_type == "kto",
        loss_type=loss_type,
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    trainer._compute_kl_logps = lambda m, batch: KTOTrainer._compute_kl_logps(trainer, m, batch)
    loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    "weights,loss_type", [((1.0, 1.0), "kto"), ((1.0, 1.33), "kto"), ((1.0, 1.33), "apo_zero_unpaired")]
)
def test_kto_loss_and_metrics_equal_trls_on_the_same_model_and_rows(assets, tok, weights, loss_type):
    from transformers import AutoModelForCausalLM

    from raytrain.objectives import KTO

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"), attn_implementation="eager").train()
    reference = AutoModelForCausalLM.from_pretrained(str(assets / "model"), attn_implementation="eager").eval()
    torch.manual_seed(3)
    with torch.no_grad():  # policy and reference apart; a random move lowers the log-probs it scores, so the
        for p in reference.parameters():  # reference is the one moved: a positive KL, in play (else clamped to 0)
            p.add_(0.05 * torch.randn_like(p))
    mb = _kto_batch(tok, KTO_ROWS)
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": {"path": "m", "attn_implementation": "eager"},
            "data": {"path": "x"},
            "training": {
                "objective": "kto",
                "global_batch_size": 5,
                "preference": {
                    "beta": 0.3,
                    "desirable_weight": weights[0],
                    "undesirable_weight": weights[1],
                    "loss": "sigmoid" if loss_type == "kto" else loss_type,
                },
            },
        }
    )
    theirs_loss, theirs = _trl_kto(model, reference, mb, 0.3, weights, loss_type)
    objective, one = KTO(spec), _OneProcess(model, reference, spec)
    n = objective.units(mb)
    with _one_rank_group():
        objective.begin(one, [mb])
    loss, stats = objective(one, mb)
    mine = objective.finish({name: float(s) / n for name, s in zip(objective.metrics, stats)})
    assert n == 5 and float(loss) / n == pytest.approx(theirs_loss, abs=1e-6)
    assert (mine["kl"] > 0) == (loss_type == "kto")  # the KL term is in play (clamped at 0 otherwise); APO has none
    for name in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name


@contextlib.contextmanager
def _one_rank_group():
    """A gloo group of one, for the one all-reduce KTO's KL estimate makes."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_kto_row_is_its_example_a_mismatched_kl_sequence_and_its_label(tok):
    # TRL's KTOTrainer pairs each row's prompt with the completion of the row before it in its batch.
    from raytrain.data.unpaired import encode_unpaired

    encoded = encode_unpaired(tok, DataSpec(path="x", format="text", seq_len=32), [json.dumps(r) for r in KTO_ROWS])
    texts = [(trained_text(tok, e[0]), trained_text(tok, e[1]), e[2][0]) for e in encoded]
    completions = [r["completion"] + tok.eos_token for r in KTO_ROWS]
    assert [t[0] for t in texts] == completions
    assert [t[1] for t in texts] == completions[-1:] + completions[:-1]
    assert [t[2] for t in texts] == [[int(r["label"])] for r in KTO_ROWS]
    for e, row in zip(encoded, KTO_ROWS):  # the KL sequence keeps the row's own prompt
        assert tok.decode(e[1][0]).startswith(row["prompt"])


@pytest.mark.parametrize(
    "fmt, row",
    [
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": "what does the fox do?"},  # LLaMA-Factory's kto_en_demo.json
                    {"role": "assistant", "content": "jumps over the hill."},
                ],
                "label": False,
            },
        ),
        (
            "chat",
            {
                "prompt": [{"role": "user", "content": "what does the fox do?"}],  # TRL's conversational shape
                "completion": [{"role": "assistant", "content": "jumps over the hill."}],
                "label": False,
            },
        ),
        ("alpaca", {"instruction": "what does the fox do?", "output": "jumps over the hill.", "label": False}),
        (
            "sharegpt",
            {
                "conversations": [
                    {"from": "human", "value": "what does the fox do?"},
                    {"from": "gpt", "value": "jumps over the hill."},
                ],
                "label": False,
            },
        ),
    ],
)
def test_each_format_gives_kto_its_completion_trained_and_its_label(tok, fmt, row):
    from raytrain.data.unpaired import encode_unpaired

    other = {**row, "label": True}  # the row before: its completion is this one's KL completion
    [_, (example, kl, tag)] = encode_unpaired(
        tok, DataSpec(path="x", format=fmt, seq_len=64), [json.dumps(other).encode(), json.dumps(row).encode()]
    )
    assert trained_text(tok, example) == "jumps over the hill.<|im_end|>" == trained_text(tok, kl)
    assert tag == ([0], [IGNORE])


def test_dpo_at_the_reference_is_ln2_with_zero_rewards(assets, tok):
    from transformers import AutoModelForCausalLM

    from raytrain.demo_assets import preference_rows

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    mb = _batch(tok, preference_rows(4))
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": {"path": "m"},
            "data": {"path": "x"},
            "training": {"objective": "dpo", "global_batch_size": 4},
        }
    )
    objective = Preference(spec)
    loss, stats = objective(_OneProcess(model, model, spec), mb)
    assert float(loss) / 4 == pytest.approx(math.log(2), abs=1e-7)
    assert [float(s) for s in stats[:4]] == [0.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- any worker count
WORLD_CASES = [
    ("dpo", "lora"),
    ("reward", "full"),
    ("kto", "full"),  # KTO full: its frozen reference copy
    ("grpo", "full"),  # GRPO: the same prompts' completions sampled, scored and trained alike
    ("grpo x2", "full"),
]  # ... with num_iterations 2: two updates on each step's completions


def _objective_steps(rank: int, world: int, device, model: str, storage: str) -> dict:
    """On every rank (spawned): 3 steps of each case on one fixed global batch of 8 rows, fp32."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import mesh_cases

    out = {}
    for objective, finetune in WORLD_CASES:
        twice, objective = objective == "grpo x2", objective.split()[0]
        spec = mesh_cases.job(
            model,
            storage,
            finetune=finetune,
            objective=objective,
            workers=world,
            grpo={"num_iterations": 2} if twice else None,
        )
        rows = (
            mesh_cases.grpo_rows(model, 8)
            if objective == "grpo"
            else mesh_cases.global_rows(True, False, 8, seed=1, kto=objective == "kto", margins=objective == "reward")
        )
        result = mesh_cases.run_case(spec, rows, steps=3)
        out["grpo x2" if twice else objective] = {k: result[k] for k in ("losses", "grad_norms", "means", "rewards")}
    return out


@pytest.mark.slow
def test_each_objective_takes_the_same_steps_at_one_two_and_three_workers(assets, tmp_path):
    # The same global batch of 8 rows at 1, 2 and 3 workers: 8, 4 or 3/3/2 rows a rank, one row a
    # micro-batch, so at 3 workers one rank runs a padding row, which must add nothing (to KTO's KL
    # estimate either; GRPO's padding rolls out a dummy prompt, trained on nothing). Losses, grad norms
    # and metric means agree to fp32 rounding; GRPO's completions are the same, so are its rewards.
    sys_path = str(Path(__file__).resolve().parent / "gpu")
    import sys

    sys.path.insert(0, sys_path)
    import local_run

    runs = {
        world: local_run.spawn(
            _objective_steps, world, torch.device("cpu"), str(assets / "model"), str(tmp_path / f"w{world}")
        )
        for world in (1, 2, 3)
    }
    for objective, _ in WORLD_CASES:
        one = runs[1][objective]
        print(f"\n[any worker count] {objective}: losses {one['losses']}")
        for world in (2, 3):
            got = runs[world][objective]
            for key in ("losses", "grad_norms"):  # after an update, AdamW's normalized step can turn a last-bit
                for step, (x, y) in enumerate(zip(got[key], one[key])):  # difference into lr's size (combinations)
                    assert abs(x - y) <= (1e-6 if step == 0 else 1e-5) * max(1.0, abs(y)), (
                        objective,
                        world,
                        key,
                        got[key],
                        one[key],
                    )
            assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(got["means"], one["means"])), objective
            assert got["rewards"] == one["rewards"], (world, got["rewards"], one["rewards"])  # the same completions
    assert len(set(runs[1]["grpo"]["rewards"])) == 3 and runs[1]["grpo"]["grad_norms"][0] > 0  # they trained
    # num_iterations 2: each step's second update weighs the same completions by the ratio to the policy
    # that sampled them, which the first update moved: tokens clipped (0 with one update: ratio 1)
    x2 = runs[1]["grpo x2"]
    print("\n[num_iterations 2] losses", x2["losses"], "means", x2["means"], "rewards", x2["rewards"])
    assert x2["means"][5] > 0 and runs[1]["grpo"]["means"][5] == 0, (x2["means"], runs[1]["grpo"]["means"])
    assert runs[1]["kto"]["losses"][0] == pytest.approx(
        0.5, abs=1e-6
    )  # the policy at its reference: each row 1 - sigmoid(0)


# ---------------------------------------------------------------- whole jobs
STEPS, PARITY_STEPS, REWARD_STEPS, EVERY = 20, 8, 12, 4
LOSS_REL_TOL = 1e-5


def untied(assets: Path) -> Path:
    """The demo model's sizes with an output layer of its own (tests/families.py's Llama): the
    learning curves asserted below were measured on it; the tied demo model's LoRA DPO, whose output
    layer stays frozen with its embedding, reaches 0.78-0.88 held-out accuracy in these 20 steps."""
    import families

    return families.build("llama", assets, assets.parent / "untied-llama")


def dpo_job(
    assets,
    storage,
    name,
    strategy="fsdp2",
    finetune="lora",
    objective="dpo",
    steps=PARITY_STEPS,
    lr=None,
    data="pairs.jsonl",
    **over,
):
    from conftest import make_job

    over.setdefault("model", {"path": str(untied(assets))})
    return make_job(
        assets,
        storage,
        name=name,
        data={
            "path": str(assets / data),
            "seq_len": 16 if data.startswith("pairs") else 24,
            "eval": {"fraction": 0.05, "every_n_steps": EVERY},
        },
        training={"objective": objective, "strategy": strategy, "finetune": finetune, "max_steps": steps},
        optimizer={"lr": lr or (1e-2 if finetune == "lora" else 1e-3), "warmup_steps": 2, "schedule": "constant"},
        checkpoint={"every_n_steps": EVERY, "keep_last": 2},
        **over,
    )


KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "eval_loss",
    "eval_rewards/accuracies",
    "step_time_s",
)
KTO_KEYS = (
    "loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "eval_loss",
    "eval_kl",
    "eval_rewards/margins",
)
REWARD_KEYS = (
    "loss",
    "accuracy",
    "margin",
    "mean_reward",
    "rewards/chosen",
    "rewards/rejected",
    "eval_loss",
    "eval_accuracy",
)


def reward_margin(i: int) -> dict:
    return {} if i % 5 == 0 else {"margin": (0.0, 0.5, 1.0, -0.5)[i % 4]}


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import local_run

    # Each job as `raytrain run` trains and exports it (the worker's path without Ray, one spawned group
    # of 2 ranks for all six: tests/gpu/local_run.py's fit_jobs); what each logs is what MLflow gets. The
    # path through Ray Train is the same whatever the objective (test_spine.py, test_vllm.py take it).
    # DPO's strategy parity as a whole job is full fine-tuning's, fsdp2 against zero3 (each
    # with its frozen reference copy, sharded its own way, and the evaluation); LoRA's and the other
    # strategies' are test_combinations.py's cases, a padding pair at 3 workers is
    # test_each_objective_takes_the_same_steps_at_one_two_and_three_workers's.
    plan = (
        [("fsdp2", "lora", "dpo", STEPS, 2)]
        + [(s, f, "dpo", PARITY_STEPS, w) for s, f, w in [("fsdp2", "full", 2), ("zero3", "full", 2)]]
        + [
            ("fsdp2", "lora", "simpo", PARITY_STEPS, 2),
            ("fsdp2", "lora", "reward", REWARD_STEPS, 2),
            ("fsdp2", "lora", "kto", PARITY_STEPS, 2),
        ]
    )
    # A reward model's head is new and trained whole: at the adapters' 1e-2 it diverged (grad norm 23).
    # Its rows carry TRL's margins (every fifth row none: margin 0).
    pairs = [json.loads(line) for line in (assets / "pairs.jsonl").read_text().splitlines()]
    (assets / "pairs-margin.jsonl").write_text(
        "".join(json.dumps({**r, **reward_margin(i)}) + "\n" for i, r in enumerate(pairs))
    )
    settings = {"reward": {"lr": 2e-3, "data": "pairs-margin.jsonl"}, "kto": {"data": "kto.jsonl"}}
    specs = {}
    for strategy, finetune, objective, steps, workers in plan:
        name = f"{objective}-{strategy}-{finetune}-{workers}w"
        specs[objective, strategy, finetune] = dpo_job(
            assets,
            tmp_path_factory.mktemp(name),
            name,
            strategy,
            finetune,
            objective,
            steps,
            scaling={"num_workers": workers},
            **settings.get(objective, {}),
        )
    steps = local_run.fit_jobs(2, [(spec, 0) for spec in specs.values()])
    out = {}
    for key, spec in specs.items():
        history = steps[f"{spec.name}/2"]
        keys = {"reward": REWARD_KEYS, "kto": KTO_KEYS}.get(key[0], KEYS)
        out[key] = SimpleNamespace(
            spec=spec, **{k.replace("/", "_"): {s: m[k] for s, m in history.items() if k in m} for k in keys}
        )
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
def test_strategies_agree_per_step_on_full_dpo(runs):
    finetune = "full"
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
def test_exported_adapter_loads_with_plain_peft_and_gives_the_last_eval(runs, tok):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain.data.order import HeldOut
    from raytrain.data.store import TokenStore

    run = runs["dpo", "fsdp2", "lora"]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(run.spec.model.path), f"{run.spec.run_dir}/final_model"
    ).eval()
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


@pytest.mark.slow
def test_a_reward_model_trains_and_its_export_scores_as_the_workers_did(runs, tok):
    # A LoRA reward model (the head trained whole) on rows with TRL's margins, through `raytrain
    # run`: MLflow has TRL's names, its loss falls, and the exported adapter, loaded with plain
    # transformers + peft and called as AutoModelForSequenceClassification (a padded batch with its
    # attention mask), gives the held-out rows, with the margins their sources hold, the loss the
    # workers' last evaluation logged.
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from raytrain.data.order import HeldOut
    from raytrain.data.store import TokenStore
    from raytrain.objectives.pairs import margins_of

    run = runs["reward", "fsdp2", "lora"]
    assert sorted(run.accuracy) == list(range(1, REWARD_STEPS + 1)) and sorted(run.eval_accuracy) == [4, 8, 12]
    print("\n[reward] eval accuracy:", run.eval_accuracy, "eval loss:", run.eval_loss)
    folder = f"{run.spec.run_dir}/final_model"
    assert json.loads(Path(folder, "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    base = AutoModelForSequenceClassification.from_pretrained(
        run.spec.model.path, num_labels=1, pad_token_id=tok.pad_token_id
    )
    model = PeftModel.from_pretrained(base, folder).eval()
    [store_dir] = [p for p in (Path(run.spec.checkpoint.storage_path) / "datasets").iterdir()]
    store = TokenStore.open(str(store_dir))
    split = HeldOut(store.rows, 0.05)
    held = split.held_rows(np.arange(split.held))
    t = torch.from_numpy(store.read(held)).long()
    margins = margins_of(t[:, 6])  # the third sequence's ids: the margin tag
    assert margins.tolist() == [reward_margin(int(i)).get("margin", 0.0) for i in held]  # the store keeps source order
    # A new head scores ~0 at first: the loss starts near the margins' mean softplus, then falls.
    start = float(torch.nn.functional.softplus(margins).mean())
    assert run.eval_loss[12] < run.eval_loss[8] < run.eval_loss[4] < start + 0.01, (run.eval_loss, start)
    for step in run.loss:  # mean_reward is the mean of the two sides' means
        assert run.mean_reward[step] == pytest.approx(
            (run.rewards_chosen[step] + run.rewards_rejected[step]) / 2, abs=1e-6
        )
    ids = torch.cat([t[:, 0], t[:, 3]])  # chosen sequences, then rejected
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits.squeeze(-1)
    chosen, rejected = scores.split(len(t))
    loss = float(-torch.nn.functional.logsigmoid(chosen - rejected - margins).mean())
    assert loss == pytest.approx(run.eval_loss[REWARD_STEPS], rel=1e-5)
    assert float((chosen > rejected).double().mean()) == pytest.approx(
        run.eval_accuracy[REWARD_STEPS], abs=1e-7
    )  # (fp32 there)


@pytest.mark.slow
def test_kto_starts_at_the_reference_and_learns_the_labelled_preference(runs):
    # Unpaired rows, each a completion labelled desirable or not (TRL's shape), through `raytrain
    # run`. Step 1: the adapter is zero, so the policy is the reference: every log-ratio and the KL
    # estimate are 0 and each row's loss is 1 - sigmoid(0), exactly 0.5. Then desirable
    # completions gain on undesirable ones, with TRL's metric names in MLflow.
    run = runs["kto", "fsdp2", "lora"]
    assert run.loss[1] == 0.5 and run.kl[1] == 0.0 and run.rewards_margins[1] == 0.0
    assert sorted(run.loss) == list(range(1, PARITY_STEPS + 1)) and sorted(run.eval_kl) == [4, 8]
    print("\n[kto] eval loss", run.eval_loss, "eval margins", run.eval_rewards_margins, "kl", run.kl)
    assert run.eval_loss[PARITY_STEPS] < 0.5 and run.eval_rewards_margins[PARITY_STEPS] > 0  # held-out rows
    assert all(
        run.rewards_margins[k] == pytest.approx(run.rewards_chosen[k] - run.rewards_rejected[k], abs=1e-9)
        for k in run.loss
    )
