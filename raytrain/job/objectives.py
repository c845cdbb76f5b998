"""What each `training.objective` is, in one table: the rows it reads, the sequences a row trains and
stores, whether it needs a frozen reference or a score head, the forwards without backward a row pays,
and the class that computes it. The job spec's properties, validate, the prepare step, telemetry and
the memory estimate all read this row; adding an objective is its own files, one row here and its
tests. Torch-free: the implementing class is named by path and imported only in the workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    rows: bool | str  # what a source row is (the store key records it): False one sequence, True a
    # preference pair, "reward" a pair and its margin, "kto" a labelled completion, "prompt" a GRPO prompt
    sequences: int  # sequences a row trains in one forward (0: `training.grpo.num_generations`)
    stored: int  # sequences a row is in the token store (data/pairs.py, unpaired.py, prompts.py)
    packs: bool  # rows may hold several documents (`data.pack`)
    reference: bool  # under full fine-tuning, a frozen copy of the starting model (LoRA: the adapter off)
    extra_forwards: int  # forwards without backward a trained row pays (the reference's; KTO's KL sequences)
    score_head: bool  # AutoModelForSequenceClassification with one label instead of the LM head
    implementation: str  # "module:Class" under raytrain.objectives


OBJECTIVES = {
    o.name: o
    for o in (
        Objective("sft", False, 1, 1, True, False, 0, False, "tokens:SFT"),
        Objective("dpo", True, 2, 2, False, True, 1, False, "pairs:Preference"),
        Objective("simpo", True, 2, 2, False, False, 0, False, "pairs:Preference"),
        Objective("reward", "reward", 2, 3, False, False, 0, True, "pairs:Reward"),
        # A KTO row's example, its mismatched KL sequence (reference and policy: 3 forwards with the
        # example's reference) and its label tag; none of the KL's under apo_zero_unpaired.
        Objective("kto", "kto", 1, 3, False, True, 3, False, "kto:KTO"),
        # GRPO's reference is needed only with a KL term (training.grpo.beta > 0): `needs_reference`.
        Objective("grpo", "prompt", 0, 2, False, True, 0, False, "grpo:GRPO"),
    )
}


def of(spec) -> Objective:
    return OBJECTIVES[spec.training.objective]


def sequences_per_row(spec) -> int:
    return of(spec).sequences or spec.training.grpo.num_generations


def needs_reference(spec) -> bool:
    """A frozen reference copy of the starting model: objectives with a reference under full fine-tuning
    (GRPO only with its KL term)."""
    t = spec.training
    return of(spec).reference and t.finetune == "full" and (t.objective != "grpo" or t.grpo.beta > 0)


def extra_forwards(spec) -> int:
    """Forwards without backward a trained row pays; KTO's unpaired APO-zero runs no KL sequence."""
    if spec.training.objective == "kto" and spec.training.preference.loss == "apo_zero_unpaired":
        return 1
    return of(spec).extra_forwards
