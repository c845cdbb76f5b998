"""GRPO's pieces without a cluster: the loss, its gradient and its metrics against TRL's own
GRPOTrainer._compute_loss for every loss type; the advantages against TRL's own code (weights,
None rewards, unscorable completions, equal rewards); the sampler (a function of its key only,
and the distribution softmax(logits / temperature), top_p as transformers filters it); the
rewards (built-ins, a user's function, and the errors a user reads); and the prompt rows as the
store keeps them.

TRL is a test-only dependency: its methods run on a stand-in `self` holding just what they read."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from raytrain.data.prompts import columns_of, encode_prompts, stored_columns, to_prompt
from raytrain.errors import JobError
from raytrain.job.grpo import RewardSpec
from raytrain.job.spec import DataSpec
from raytrain.rl.losses import advantages, summed_loss, token_terms, units_of
from raytrain.rl.rewards import Reward, RewardError, answer_of, same_answer, score
from raytrain.rl.sampling import completion_key, sample, uniforms


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets / "model"))


# ---------------------------------------------------------------- the loss
B, T = 6, 7
LENGTHS = [7, 3, 5, 1, 6, 2]  # varied: grpo's per-completion mean and the token means differ


def trl_loss(logps, mask, old, ref, adv, g, is_ratio=None, tool_mask=None, max_completion_length=T):
    """TRL's GRPOTrainer._compute_loss on one micro-batch, one process (its gathers are the identity),
    the policy's log-probs given (the model's forward is not what is compared), `g` a GRPOSpec;
    `tool_mask` (TRL's, multi-turn): 0 on tool-result tokens."""
    n, width = logps.shape
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(
        num_processes=1,
        process_index=0,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=g.importance_sampling_level,
        beta=g.beta,
        epsilon_low=g.epsilon,
        epsilon_high=g.high,
        loss_type=g.loss_type,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        max_completion_length=max_completion_length,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=accelerator,
        args=SimpleNamespace(
            delta=None,
            use_bias_correction_kl=False,
            steps_per_generation=1,
            sapo_temperature_pos=g.sapo_temperature_pos,
            sapo_temperature_neg=g.sapo_temperature_neg,
        ),
    )
    loss_mask = mask if tool_mask is None else mask * tool_mask
    inputs = {
        "prompt_ids": torch.ones(n, 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.ones(n, width, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": loss_mask.sum(),  # TRL's: completion_mask x tool_mask, summed
    }
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask.long()
    if g.beta:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


# Every loss type at both importance-sampling levels (GSPO: sequence), with and without the KL term.
# CISPO's clip is its upper bound on the ratio (epsilon_high, 1.1 here so some ratios pass it, at both levels).
LOSSES = [(t, level) for t in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo") for level in ("token", "sequence")]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type,level", LOSSES)
def test_the_loss_and_its_gradient_equal_trls_for_each_loss_type(loss_type, level, beta):
    from raytrain.job.grpo import GRPOSpec

    g = GRPOSpec(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_high=1.1 if loss_type == "cispo" else 0.28,
    )
    gen = torch.Generator().manual_seed(0)
    logps = (-2 * torch.rand(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()
    # old != policy: ratios beyond 0.8 and 1.28 on both sides, so both clips (and their zero gradient) are exercised
    old = logps.detach() + 0.35 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logps.detach() + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9, -0.2], dtype=torch.float64)

    loss, kl, low, high = token_terms(logps, old, ref, adv, mask, g)
    ours = summed_loss(loss, mask, loss_type) / units_of(loss_type, B, int(mask.sum()), T)
    theirs, metrics = trl_loss(logps, mask, old, ref, adv, g)

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    (ours_grad,), (their_grad,) = torch.autograd.grad(ours, logps), torch.autograd.grad(theirs, logps)
    torch.testing.assert_close(ours_grad, their_grad, rtol=0, atol=1e-6)
    assert ours_grad.abs().sum() > 0

    over = mask if level == "token" else torch.ones(B, 1, dtype=mask.dtype)  # TRL counts completions at sequence level

    def mean(x):  # raytrain's metrics: means over completion tokens or completions (GRPO.finish); TRL counts in float32
        return ((x * over).sum() / over.sum()).item()

    if loss_type == "cispo":
        assert metrics["cispo_clip_ratio"] == pytest.approx(mean(high), rel=1e-6) and high.sum() > 0
    elif loss_type == "sapo":
        assert not any(k.startswith("clip_ratio") for k in metrics)
    else:
        if level == "token":  # the case exercises both clips (a completion's mean ratio need not pass either)
            assert ((low * mask).sum() > 0) and ((high * mask).sum() > 0)
        assert metrics["clip_ratio/low_mean"] == pytest.approx(mean(low), rel=1e-6)
        assert metrics["clip_ratio/high_mean"] == pytest.approx(mean(high), rel=1e-6)
        assert metrics["clip_ratio/region_mean"] == pytest.approx(mean(torch.maximum(low, high)), rel=1e-6)
    assert (kl is None) == (beta == 0.0) and ("kl" in metrics) == (beta != 0.0)
    if beta:
        assert metrics["kl"] == pytest.approx(((kl.detach() * mask).sum() / mask.sum()).item(), rel=1e-6)


def test_equal_rewards_in_a_group_give_zero_gradient():
    from raytrain.job.grpo import GRPOSpec

    # num_iterations 1: the loop passes old = logps.detach(), so the ratio is exactly 1 and nothing is clipped;
    # a completion with advantage 0 (its group's rewards all equal) must not move the policy at all.
    logps = (-3 * torch.rand(4, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
    g = GRPOSpec(epsilon_high=0.28)
    loss, kl, low, high = token_terms(logps, logps.detach(), None, torch.zeros(4), torch.ones(4, 5), g)
    (grad,) = torch.autograd.grad(summed_loss(loss, torch.ones(4, 5), "dapo"), logps)
    assert kl is None and torch.equal(grad, torch.zeros_like(grad))
    assert torch.equal(torch.exp(logps - logps.detach()), torch.ones(4, 5))
    assert low.sum() == 0 and high.sum() == 0
    # with an advantage, the gradient of the unclipped surrogate at ratio 1 is -A per token
    loss, *_ = token_terms(logps, logps.detach(), None, torch.tensor([1.0, -2.0, 0.0, 0.5]), torch.ones(4, 5), g)
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert torch.equal(grad, -torch.tensor([1.0, -2.0, 0.0, 0.5])[:, None].expand(4, 5))


def trl_importance_ratio(trainer, engine, mask, g):
    """TRL's vLLM importance-sampling ratio, its own inline block of
    GRPOTrainer._generate_and_score_completions (from the log-prob difference to the mode's
    clamp or mask), sliced from the installed source and run with the names it reads."""
    import inspect
    import textwrap

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    begin = source.index("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask")
    begin = source.rindex("\n", 0, begin) + 1
    end = source.index("# Compute the per-token log probabilities for the reference model", begin)
    block = textwrap.dedent(source[begin : source.rindex("\n", 0, end) + 1])
    names = {
        "torch": torch,
        "math": math,
        "mask": mask,
        "old_per_token_logps": trainer,
        "sampling_per_token_logps": engine,
        "self": SimpleNamespace(
            vllm_importance_sampling_mode=g.vllm_importance_sampling_mode,
            vllm_importance_sampling_clip_min=g.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=g.vllm_importance_sampling_clip_max,
        ),
    }
    exec(compile(block, "trl/trainer/grpo_trainer.py", "exec"), names)
    return names["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_the_engine_mismatch_correction_equals_trls(mode):
    """engine: vllm's truncated importance sampling: TRL's ratio (its code) in each mode, bounds on
    both sides, and the loss it weights equal to TRL's _compute_loss with the correction on."""
    from raytrain.job.grpo import GRPOSpec
    from raytrain.rl.losses import importance_ratio

    g = GRPOSpec(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=1.5,
        loss_type="dapo",
    )
    gen = torch.Generator().manual_seed(1)
    logps = (-2 * torch.rand(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()
    engine = logps.detach() + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # ratios past both bounds
    ours = importance_ratio(logps.detach(), engine, mask, g)
    theirs = trl_importance_ratio(logps.detach(), engine, mask, g)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    inside = (ours > 0.5) & (ours < 1.5)
    assert inside.any() and (~inside).any()  # both bounds are crossed, so the mode matters
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9, -0.2], dtype=torch.float64)
    loss, *_ = token_terms(logps, logps.detach(), None, adv, mask, g, ours)
    mine = summed_loss(loss, mask, "dapo") / units_of("dapo", B, int(mask.sum()), T)
    their_loss, _ = trl_loss(logps, mask, logps.detach(), None, adv, g, is_ratio=theirs)
    assert mine.item() == pytest.approx(their_loss.item(), rel=1e-9) and mine.item() != 0


# ---------------------------------------------------------------- advantages
def trl_advantages(scores, weights, group, scale):
    """TRL's own advantage code, run as it stands: the block of
    GRPOTrainer._generate_and_score_completions from the unscorable mask to the advantages
    (multi_objective_aggregation sum_then_normalize), sliced from the installed source and
    executed with the names it reads. It is inline there, not a method; a TRL release that
    moves it fails here loudly rather than leaving a stale copy in this file."""
    import inspect
    import textwrap

    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    begin = source.index("        unscorable_mask = torch.isnan(rewards_per_func)")
    last = "        advantages = torch.nan_to_num(advantages, nan=0.0)\n"
    block = textwrap.dedent(source[begin : source.index(last, begin) + len(last)])
    names = {
        "torch": torch,
        "nanstd": nanstd,
        "rewards_per_func": scores,
        "num_generations": group,
        "device": "cpu",
        "self": SimpleNamespace(
            multi_objective_aggregation="sum_then_normalize", reward_weights=weights, scale_rewards=scale
        ),
    }
    exec(compile(block, "trl/trainer/grpo_trainer.py", "exec"), names)
    return names["advantages"], names["rewards"], names["is_std_zero"]


nan = math.nan
SCORES = torch.tensor(
    [
        [1.0, 0.2],
        [0.0, nan],
        [1.0, 0.9],
        [0.0, 0.1],  # a reward returned None once: nansum keeps the other
        [nan, nan],
        [1.0, 0.5],
        [0.0, 0.3],
        [1.0, 0.0],  # no reward judged the first: unscorable, out of the baseline
        [1.0, 0.5],
        [1.0, 0.5],
        [1.0, 0.5],
        [1.0, 0.5],  # all equal: std 0, advantage exactly 0
    ],
    dtype=torch.float64,
)
WEIGHTS = torch.tensor([1.0, 0.5], dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    adv, summed, zero_std = advantages(SCORES.clone(), WEIGHTS, 4, scale)
    their_adv, their_summed, their_zero = trl_advantages(SCORES.clone(), WEIGHTS, 4, scale)
    # TRL's nanstd rounds its Bessel correction count / (count - 1) to float32: equal to that precision
    torch.testing.assert_close(adv, their_adv, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(summed, their_summed, equal_nan=True)
    assert torch.equal(zero_std, their_zero)
    assert adv[4] == 0 and torch.isnan(summed[4])  # the unscorable completion does not move the policy
    assert torch.equal(adv[8:], torch.zeros(4, dtype=adv.dtype))  # equal rewards: exactly 0, so zero gradient
    assert torch.cat([adv[:4], adv[5:8]]).abs().min() > 0.1  # the others carry a signal
    if scale == "group":
        assert torch.equal(zero_std, torch.tensor([False] * 8 + [True] * 4))


def test_a_group_no_reward_judged_is_not_a_zero_std_group():
    scores = torch.tensor([[1.0], [0.0], [nan], [nan]], dtype=torch.float64)
    weights = torch.tensor([1.0], dtype=torch.float64)
    assert torch.equal(advantages(scores, weights, 2, "group")[2], trl_advantages(scores, weights, 2, "group")[2])


# ---------------------------------------------------------------- sampling
def test_sampling_is_a_function_of_its_key_not_of_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    keys = torch.tensor([completion_key(0, 3, (0, 0, r), k) for r, k in [(0, 0), (0, 1), (1, 0), (2, 5)]])
    for t in range(4):
        batch = sample(logits, keys, t, 0.9, 0.95)
        alone = torch.stack([sample(logits[i : i + 1], keys[i : i + 1], t, 0.9, 0.95)[0] for i in range(4)])
        order = torch.tensor([2, 0, 3, 1])
        assert torch.equal(batch, alone) and torch.equal(sample(logits[order], keys[order], t, 0.9, 0.95), batch[order])

    # different keys (and positions) draw differently from the same distribution
    flat = torch.zeros(200, 50)
    many = torch.tensor([completion_key(0, 0, (0, 0, 0), k) for k in range(200)])
    assert len(set(sample(flat, many, 0, 1.0, 1.0).tolist())) > 40
    assert not torch.equal(sample(flat, many, 0, 1.0, 1.0), sample(flat, many, 1, 1.0, 1.0))


def test_the_sampler_draws_softmax_of_logits_over_temperature_and_top_p_as_transformers():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([1.0, 0.7, 0.4, -1.0, 0.0])
    keys = torch.tensor([completion_key(7, 1, (0, 0, r), 0) for r in range(20000)])
    z = logits / 0.7
    drawn = sample(logits.expand(len(keys), 5), keys, 3, 0.7, 1.0)
    frequency = torch.bincount(drawn, minlength=5).double() / len(keys)
    assert (frequency - z.softmax(-1).double()).abs().max() < 0.015

    kept = TopPLogitsWarper(0.6)(None, z[None].clone())[0]
    assert 1 < int(torch.isfinite(kept).sum()) < 5  # the nucleus drops some tokens here, not all but one
    drawn = sample(logits.expand(len(keys), 5), keys, 3, 0.7, 0.6)
    frequency = torch.bincount(drawn, minlength=5).double() / len(keys)
    assert torch.equal(frequency > 0, torch.isfinite(kept))  # never outside the nucleus
    assert (frequency - kept.softmax(-1).double()).abs().max() < 0.015  # renormalized within it


def test_uniforms_and_keys():
    keys = torch.tensor([completion_key(0, 0, (0, 0, r), 0) for r in range(100_000)])
    u = uniforms(keys, 5)
    assert u.shape == (100_000,) and u.dtype == torch.float64
    assert (u > 0).all() and (u < 1).all()  # strictly inside: a draw never lands on a cdf's end
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12**-0.5) < 0.01
    assert u.unique().numel() > 99_000  # no repeats across keys
    assert (uniforms(keys, 6) != u).float().mean() > 0.999  # another position, another draw
    base = completion_key(0, 3, (0, 1, 5), 2)
    for other in [
        (1, 3, (0, 1, 5), 2),
        (0, 4, (0, 1, 5), 2),
        (0, 3, (1, 1, 5), 2),
        (0, 3, (0, 2, 5), 2),
        (0, 3, (0, 1, 6), 2),
        (0, 3, (0, 1, 5), 3),
    ]:
        assert completion_key(*other) != base, other
    assert completion_key(0, 3, (0, 1, 5), 2) == base  # a restart resamples the same completion


# ---------------------------------------------------------------- rewards
@pytest.mark.parametrize(
    "completion, reference, pattern, same",
    [
        ("so 8 * 9 = 72.\n#### 72", "The answer is 72.", None, True),  # GSM8K's mark and a sentence
        ("we get \\boxed{1,000} in all", "1000", None, True),
        ("it costs 3.50", "$3.5", None, True),
        ("first 12, then 13", "12", None, False),  # the last number is the answer
        ("<think>5 or 6</think><answer> 42 </answer> and 7", "42", r"<answer>(.*?)</answer>", True),
        ("<think>42</think> no answer tag", "42", r"<answer>(.*?)</answer>", False),
        ("I do not know", "0", None, False),  # no number is no answer, not 0
    ],
)
def test_answers_compare_as_numbers(completion, reference, pattern, same):
    assert same_answer(answer_of(completion, pattern), answer_of(reference)) is same


def test_the_builtin_rewards():
    completions = [
        [{"role": "assistant", "content": "<think>6 x 12</think> #### 72"}],
        [{"role": "assistant", "content": "it is 70"}],
        [{"role": "assistant", "content": "I cannot say"}],
    ]
    ids, columns, rows = [[5, 6, 7, 0], [5, 6], [1] * 8], {"solution": ["72", "72", "72"]}, [(0, 0, 1)] * 3
    prompts = [[{"role": "user", "content": "6 x 12?"}]] * 3
    accuracy = Reward(RewardSpec(builtin="accuracy", column="solution"), 8)
    form = Reward(RewardSpec(builtin="format", pattern=r"^<think>.*</think>"), 8)
    length = Reward(RewardSpec(builtin="length", weight=-0.5), 8)
    assert accuracy(prompts, completions, ids, columns, rows) == [1.0, 0.0, 0.0]
    assert form(prompts, completions, ids, columns, rows) == [1.0, 0.0, 0.0]
    assert length(prompts, completions, ids, columns, rows) == [0.5, 0.25, 1.0]
    assert score([accuracy, length], prompts, completions, ids, columns, rows) == [[1.0, 0.5], [0.0, 0.25], [0.0, 1.0]]
    assert (length.name, length.weight) == ("length", -0.5)
    # A column the rows lack: named, with the ones they have. A JobError raised in a worker ends the
    # job with its one line, not retried (as a tampered checkpoint's refusal does in test_strategies.py).
    assert issubclass(RewardError, JobError)
    with pytest.raises(
        RewardError,
        match=r"accuracy reads column 'solution', which row \(0, 0, 1\) does not have "
        r"\(its columns: \['answer'\]\); set `column` to one of them",
    ):
        Reward(RewardSpec(builtin="accuracy", column="solution"), 8)(
            prompts, completions, ids, {"answer": ["72"] * 3}, rows
        )


USER_REWARDS = """
SEEN = []

def judge(prompts, completions, completion_ids, **columns):
    SEEN.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
    return [None if "?" in c else float(len(c)) for c in completions]

def broken(prompts, completions, **kw):
    raise KeyError("solution")

def short(prompts, completions, **kw):
    return [1.0] * (len(completions) - 1)

def wordy(prompts, completions, **kw):
    return ["good"] * len(completions)

not_a_function = 3
"""


def test_a_users_reward_function_and_its_errors(tmp_path, monkeypatch):
    (tmp_path / "grpo_test_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts, completions, ids = ["p1", "p1", "p2"], ["abc", "what?", "z"], [[1, 2], [3], [4, 5, 6]]
    columns, rows = {"solution": ["7", "7", "8"], "level": [1, 1, 3]}, [(0, 0, 4), (0, 0, 9)]
    judge = Reward(RewardSpec(function="grpo_test_rewards:judge"), 16)
    out = judge(prompts, completions, ids, columns, rows)
    assert out[0] == 3.0 and math.isnan(out[1]) and out[2] == 1.0  # None: this completion is not judged
    import grpo_test_rewards

    assert grpo_test_rewards.SEEN == [dict(prompts=prompts, completions=completions, completion_ids=ids, **columns)]
    assert judge.name == "judge"

    for name in ["broken", "short", "wordy"]:  # each stops the job with the function's name, not a traceback
        reward = Reward(RewardSpec(function=f"grpo_test_rewards:{name}"), 16)
        with pytest.raises(RewardError, match=f"grpo_test_rewards:{name}"):
            reward(prompts, completions, ids, columns, rows)
    for target in ["grpo_no_such_module:f", "grpo_test_rewards:missing", "grpo_test_rewards:not_a_function"]:
        with pytest.raises(RewardError, match=target) as caught:
            Reward(RewardSpec(function=target), 16)
        assert isinstance(caught.value, JobError)


def trl_model_rewards(model, tokenizer, prompts, completions):
    """TRL's GRPOTrainer._calculate_rewards with a reward model (its nn.Module branch), one process."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)  # TRL's method on a bare instance: only what it reads is set
    trainer.__dict__.update(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[model],
        reward_processing_classes=[tokenizer],
        reward_func_names=["rm"],
        chat_template_kwargs={},
        state=SimpleNamespace(global_step=0),
        environments=None,
        _log_completion_extra=None,
        _log_metric=None,
        is_deepspeed_enabled=False,
        args=SimpleNamespace(device=torch.device("cpu"), log_completions=False, report_to=[]),
    )
    import trl.trainer.grpo_trainer as g

    gather = g.gather
    g.gather = lambda t: t  # accelerate's gather across processes: one process here
    try:
        inputs = [{"prompt": p} for p in prompts]
        return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, [[1]] * len(prompts))[:, 0]
    finally:
        g.gather = gather


def test_a_reward_model_scores_as_trls_grpo_trainer(assets, tmp_path):
    # A reward model as `raytrain run` exports one for objective: reward (a ...ForSequenceClassification
    # with one label), whole, and as a LoRA adapter over its base: the scores TRL's trainer gives the same
    # prompt + completion texts, plain and conversational (rendered by the reward tokenizer's template).
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets / "model"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(assets / "model"), num_labels=1, pad_token_id=tok.pad_token_id
    ).eval()
    whole = tmp_path / "rm"
    model.save_pretrained(str(whole))
    tok.save_pretrained(str(whole))
    lora = get_peft_model(
        AutoModelForSequenceClassification.from_pretrained(
            str(assets / "model"), num_labels=1, pad_token_id=tok.pad_token_id
        ),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS", init_lora_weights=False
        ),
    )
    adapter = tmp_path / "rm-lora"
    lora.save_pretrained(str(adapter))
    merged = lora.merge_and_unload().eval()

    plain = (["the red fox", "a blue owl", "the red fox"], [" jumps over.", " sees", " sleeps all day long"])
    chat = (
        [[{"role": "user", "content": p}] for p in plain[0]],
        [[{"role": "assistant", "content": c}] for c in plain[1]],
    )
    for folder, reference in ((whole, model), (adapter, merged)):
        reward = Reward(RewardSpec(model=str(folder)), 16)
        assert reward.name == folder.name
        for prompts, completions in (plain, chat):
            ours = reward(prompts, completions, [[1]] * 3, {}, [(0, 0, i) for i in range(3)])
            theirs = trl_model_rewards(reference, tok, prompts, completions)
            assert ours == pytest.approx(theirs.tolist(), abs=1e-5), (folder.name, ours, theirs)
            assert len(set(ours)) == 3  # the completions score apart: the head reads each text's own last token
    (whole / "model.safetensors").rename(whole / "gone.safetensors")
    with pytest.raises(RewardError, match="does not load as a reward model"):
        Reward(RewardSpec(model=str(whole)), 16)


# ---------------------------------------------------------------- prompt rows
def test_prompt_rows_as_the_store_keeps_them(tok):
    data = DataSpec(path="x", format="prompt", seq_len=256)
    row = {
        "prompt": "the red fox jumps over the hill. what color is the fox?",
        "solution": "red",
        "note": "naïve café — 日本語 ✓",
        "level": 3,
        "tags": ["a", None],
        "meta": {"k": 1.5},
    }
    prompt, columns = to_prompt(data, row)
    assert prompt == row["prompt"] and columns == row  # the rewards get every column back as written
    assert columns_of(stored_columns(columns)) == row

    long = {"prompt": " ".join(["the red fox"] * 12)}  # 143 bytes (they fit), 36 tokens (they do not)
    rows = [row, long, {"question": "what?"}, {"prompt": "hi", "solution": "x" * 250}, {"prompt": "  "}]
    out = encode_prompts(tok, data, rows, completion_room=230)
    (ids, labels), (raw, raw_labels) = out[0]
    # the prompt as written, no special tokens (GRPOTrainer's); flagged labelled so its length survives the padding
    assert ids == tok(row["prompt"], add_special_tokens=False)["input_ids"] and labels == ids
    assert raw_labels == raw and columns_of(raw) == row and all(0 <= b < 256 for b in raw)
    assert isinstance(out[1], ValueError) and "max_completion_length=230" in str(out[1])
    assert isinstance(out[2], ValueError) and "'prompt'" in str(out[2])
    assert isinstance(out[3], ValueError) and "seq_len=256" in str(out[3]) and "bytes" in str(out[3])
    assert isinstance(out[4], ValueError) and "empty" in str(out[4])
    assert len(tok(long["prompt"], add_special_tokens=False)["input_ids"]) > 256 - 230 >= len(ids)  # the case's premise


def test_sft_rows_are_prompts_with_their_last_assistant_turn_as_the_answer(tok):
    # LLaMA-Factory's alpaca and sharegpt rows, as users keep them for SFT
    alpaca = {
        "instruction": "add the numbers",
        "input": "2 and 3",
        "output": "5",
        "system": "be brief.",
        "history": [["hi", "hello"]],
        "level": 1,
    }
    prompt, columns = to_prompt(DataSpec(path="x", format="alpaca", seq_len=512), alpaca)
    assert prompt == [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "add the numbers\n2 and 3"},
    ]
    assert columns == {"level": 1, "answer": "5", "prompt": prompt}  # the mapped columns consumed, the rest kept
    sharegpt = {
        "conversations": [{"from": "human", "value": "2 + 3?"}, {"from": "gpt", "value": "\\boxed{5}"}],
        "source": "gsm",
    }
    data = DataSpec(path="x", format="sharegpt", seq_len=512)
    prompt, columns = to_prompt(data, sharegpt)
    assert prompt == [{"role": "user", "content": "2 + 3?"}] and columns["answer"] == "\\boxed{5}"
    assert columns["source"] == "gsm" and "conversations" not in columns
    (ids, _), (raw, _) = encode_prompts(tok, data, [sharegpt], completion_room=128)[0]
    assert (
        ids
        == tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        and columns_of(raw) == columns
    )
    ends_with_user = {
        "conversations": [
            {"from": "human", "value": "2 + 3?"},
            {"from": "gpt", "value": "5"},
            {"from": "human", "value": "and 4 + 4?"},
        ]
    }
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        to_prompt(data, ends_with_user)


def test_a_conversational_prompt_is_rendered_by_the_chat_template(tok):
    data = DataSpec(path="x", format="prompt", seq_len=256)
    messages = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "what color is the fox?"}]
    row = {"prompt": messages, "solution": "rouge ✓"}
    prompt, columns = to_prompt(data, row)
    assert prompt == messages and columns == row
    (ids, labels), (raw, _) = encode_prompts(tok, data, [row], completion_room=128)[0]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # the completion answers as the assistant
    assert ids == labels == tok(text, add_special_tokens=False)["input_ids"] and columns_of(raw) == row
