"""`training.chunked_loss`: the cross-entropy a chunk of tokens at a time, each chunk's logits
recomputed in backward. The same per-token losses and gradients as the whole-logits loss (fp32
tolerance: the sums run in another order), with a fraction of its peak memory. Its use inside a
real fsdp2 run is tests/test_strategies.py's (the eager run's losses). Last, the output layer's other
memory: a tied table's gradient (modeling.sparse_tied_lookup)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from raytrain.data import IGNORE
from raytrain.job.spec import JobSpec
from raytrain.objectives import Hidden, sequence_logps, targets_of, token_loss


def problem(tokens=300, hidden=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(2, tokens, hidden, generator=g, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=0.2, generator=g)
    labels = torch.randint(vocab, (2, tokens), generator=g)
    labels[0, :40] = IGNORE  # a prompt
    labels[1, -25:] = IGNORE  # padding
    return states, head, labels


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [64, 299, 1000])  # several chunks with a ragged last one; one chunk
def test_chunked_loss_equals_the_whole_logits_loss_and_its_gradients(chunk):
    states, head, labels = problem()
    whole, chunked = head(states), Hidden(states, head, chunk, contextlib.nullcontext)
    targets = targets_of(labels)
    loss_whole, loss_chunked = token_loss(whole, targets), token_loss(chunked, targets)
    torch.testing.assert_close(loss_chunked, loss_whole, rtol=1e-6, atol=0)
    for a, b in zip(grads(loss_chunked, states, head.weight), grads(loss_whole, states, head.weight)):
        # The weight's gradient is summed over chunks, then over tokens: fp32 rounding at its scale.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    # DPO's per-sequence log-probabilities (what the preference losses take).
    lp_c, lp_w = sequence_logps(chunked, targets), sequence_logps(whole, targets)
    torch.testing.assert_close(lp_c, lp_w, rtol=1e-6, atol=0)
    assert loss_whole.item() > 0


def liger_reference(
    input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    **unused,
):
    """Liger's `liger_fused_linear_cross_entropy` (its signature and per-token result) in plain torch:
    its kernels are Triton's, CUDA only; the GPU suite runs the real one."""
    assert ce_weight is None and not lse_square_scale and not label_smoothing and softcap is None and not return_z_loss
    return torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(input, weight, bias).float(), target, ignore_index=ignore_index, reduction=reduction
    )


def test_liger_fused_loss_is_called_as_it_takes_its_arguments_and_only_on_cuda(assets, tmp_path):
    """Where Liger runs (kernels.fused_loss: CUDA, chunked_loss auto), the loss hands it the hidden
    states and the output layer as its function takes them: the whole logits' losses, gradients and
    per-sequence log-probs. Never on CPU workers."""
    from conftest import make_job

    from raytrain.model import kernels

    states, head, labels = problem()
    targets = targets_of(labels)
    fused, whole = Hidden(states, head, 0, contextlib.nullcontext, liger_reference), head(states)
    loss_fused, loss_whole = token_loss(fused, targets), token_loss(whole, targets)
    torch.testing.assert_close(loss_fused, loss_whole, rtol=1e-6, atol=0)
    for a, b in zip(grads(loss_fused, states, head.weight), grads(loss_whole, states, head.weight)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    torch.testing.assert_close(sequence_logps(fused, targets), sequence_logps(whole, targets), rtol=1e-6, atol=0)
    assert kernels.fused_loss(make_job(assets, tmp_path), torch.device("cpu")) is None


def test_liger_fused_loss_only_from_the_release_that_takes_per_row_gradients_rightly(assets, tmp_path):
    """Before liger-kernel 0.8.2 the fused loss's backward under reduction="none" scaled every row's
    gradient by the first row's: DPO, KTO and SimPO trained on wrong gradients with no error. An older
    one is not used, and the kernel line says why (raytrain's own loss runs)."""
    from conftest import make_job

    from raytrain.model import kernels

    assert [kernels.liger_fused_allowed(v) for v in ("0.7.9", "0.8.1", "0.8.2.dev0", "0.8.2", "0.9.1", "0.10.0")] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    assert not kernels.liger_fused_allowed("not-a-version")
    spec, cuda = make_job(assets, tmp_path, training={"objective": "sft"}), torch.device("cuda")
    note = kernels.fused_loss_note(spec, cuda, version="0.8.1")
    assert "liger-kernel 0.8.1 predates 0.8.2" in note and "raytrain's, not Liger's" in note
    assert kernels.fused_loss_note(spec, cuda, version="0.8.2") == ""
    assert kernels.fused_loss_note(spec, torch.device("cpu"), version="0.8.1") == ""  # it would not run there anyway


def test_liger_block_kernels_run_only_where_cuda_blocks_stay_eager_and_whole(assets, tmp_path):
    """Liger's RMSNorm, SwiGLU and RoPE (kernels.block_kernels) take a block's ops only on CUDA, only
    where the blocks are not compiled (inductor fuses those ops itself) and not under tensor
    parallelism (DTensor norms); a CPU worker's model is never patched."""
    from conftest import make_job

    from raytrain.model import kernels

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    spec = make_job(assets, tmp_path)
    tp = spec.model_copy(update={"scaling": spec.scaling.model_copy(update={"tensor_parallel": 2})})
    assert kernels.liger_blocks_apply(spec, cuda, compiled=False)
    assert not kernels.liger_blocks_apply(spec, cuda, compiled=True)
    assert not kernels.liger_blocks_apply(tp, cuda, compiled=False)
    assert not kernels.liger_blocks_apply(spec, cpu, compiled=False)
    model = torch.nn.Linear(2, 2)  # reached only past the rule: a CPU worker returns before any import
    assert kernels.block_kernels(spec, cpu, False, model) is None


def test_grpos_log_probs_at_a_temperature_are_the_whole_logits_ones_with_a_biased_output_layer():
    # GRPO scales the logits by 1/temperature (TRL's). The chunked path scaled the hidden states
    # instead, which is the same only for an output layer without a bias (seen: off by the bias's
    # share for a head with one, e.g. Phi-2's or GPT-J's).
    from raytrain.objectives.grpo import token_logps

    states, head, labels = problem()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.normal_(std=1.0, generator=torch.Generator().manual_seed(1))
    targets = targets_of(labels)
    for layer in (head, biased):
        whole = token_logps(layer(states), targets, temperature=0.7)
        chunked = token_logps(Hidden(states, layer, 128, contextlib.nullcontext), targets, temperature=0.7)
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


PEAK = """
import json, sys, contextlib, torch
from raytrain.objectives import Hidden, targets_of, token_loss
torch.manual_seed(0)
tokens, hidden, vocab, chunk = 4096, 64, 32000, {chunk}
states = torch.randn(1, tokens, hidden, requires_grad=True)
head = torch.nn.Linear(hidden, vocab, bias=False)
labels = torch.randint(vocab, (1, tokens))
def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak resident set starts again from here
before = status("VmRSS")
out = Hidden(states, head, chunk, contextlib.nullcontext) if chunk else head(states)
token_loss(out, targets_of(labels)).backward()
print(json.dumps({{"peak": status("VmHWM") - before, "loss": float(token_loss(out, targets_of(labels)))}}))
"""


def peak_of(chunk: int) -> dict:
    # Blocks of 256 KiB and more are returned to the OS when freed, so the resident peak is the live tensors'.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(256 << 10), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PEAK.format(chunk=chunk)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_chunked_loss_never_holds_the_whole_logits():
    """4096 tokens at a 32k vocabulary: the whole fp32 logits are 500 MiB, their gradient as much."""
    whole, chunked = peak_of(0), peak_of(512)
    mib = 1 << 20
    print(
        f"\n[chunked loss] peak above the inputs: whole logits {whole['peak'] / mib:.0f} MiB, "
        f"chunks of 512 tokens {chunked['peak'] / mib:.0f} MiB"
    )
    assert abs(chunked["loss"] - whole["loss"]) <= 1e-6 * whole["loss"]
    assert whole["peak"] > 4096 * 32000 * 4  # at least the whole logits once
    assert chunked["peak"] < whole["peak"] / 4


def test_auto_chunks_a_128k_vocabulary_at_long_sequences_only(assets, tmp_path):
    llama3 = {"vocab_size": 128256}
    job = {
        "name": "j",
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "text.jsonl"), "seq_len": 4096},
        "training": {"micro_batch_size": 1},
    }
    spec = JobSpec.model_validate(job)
    assert spec.loss_chunk_tokens(llama3) == 523  # 256 MiB of fp32 logits a chunk
    assert spec.loss_chunk_tokens({"vocab_size": 384}) == 0  # small logits: the plain loss
    assert spec.loss_chunk_tokens({**llama3, "final_logit_softcapping": 30.0}) == 0  # logits transformed
    short = JobSpec.model_validate({**job, "data": {**job["data"], "seq_len": 512}})
    assert short.loss_chunk_tokens(llama3) == 0  # 512 x 128k x 4 B = 250 MiB
    zero3 = JobSpec.model_validate({**job, "training": {"micro_batch_size": 1, "strategy": "zero3"}})
    assert zero3.loss_chunk_tokens(llama3) == 0


def test_a_tied_table_trains_with_one_table_sized_tensor_less():
    """A full fine-tune of a model whose input embedding is its output layer (modeling.sparse_tied_lookup,
    set by every torch strategy): the same gradients as the dense lookup, and one table-sized tensor less
    alive at the backward's peak (torch's own allocations, from the profiler)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain.model import modeling

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(32000, (1, 16))

    def backward() -> tuple[int, dict]:
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model(input_ids=ids, labels=ids).loss.backward()
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        live = peak = 0
        for _, n in events:
            live += n
            peak = max(peak, live)
        return peak, {n: p.grad.clone() for n, p in model.named_parameters()}

    dense_peak, dense = backward()
    assert not modeling.sparse_tied_lookup(model, torch.device("cuda"))  # accelerators keep the dense lookup
    assert modeling.sparse_tied_lookup(model, torch.device("cpu"))
    sparse_peak, sparse = backward()
    table = 32000 * 64 * 4
    print(
        f"\n[tied table] backward's peak above the weights: dense lookup {dense_peak / 2**20:.1f} MiB, "
        f"sparse {sparse_peak / 2**20:.1f} MiB (a table {table / 2**20:.1f})"
    )
    assert not sparse["model.embed_tokens.weight"].is_sparse  # what FSDP2, DDP and AdamW take
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-9)
    assert dense_peak - sparse_peak >= 0.9 * table
    untied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    assert not modeling.sparse_tied_lookup(untied, torch.device("cpu"))  # its embedding's own gradient stays dense


def _split_table_on_two_ranks(rank: int, port: int, out: str) -> None:
    """One rank of 2 on gloo: the split table's lookup and loss with their padded length asked of the
    ranks (an all-gather read on the host) and told by the host (the micro-batch's most tokens)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from raytrain.strategies import vocab_parallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=g)  # the same whole table on both ranks; each keeps its rows
    first, n = vocab_parallel.rows(50, 2, rank)
    weight = DTensor.from_local(
        table[first : first + n], mesh, [Shard(0)], run_check=False, shape=table.shape, stride=table.stride()
    )
    own = (7, 4)[rank]  # ragged: the ranks' micro-batches differ by rows
    g = torch.Generator().manual_seed(1 + rank)
    states = torch.randn(own, 8, generator=g)
    labels = torch.randint(50, (own,), generator=g)
    labels[0] = IGNORE
    embedding = torch.nn.Embedding(50, 8)
    embedding.weight = torch.nn.Parameter(weight, requires_grad=False)
    report = {}
    for how, longest in (("asked", None), ("told", 7)):
        x = states.clone().requires_grad_(True)
        loss = vocab_parallel.Loss(0).sized(longest)(x, weight, labels)
        loss.sum().backward()
        embedding.longest = longest
        found = vocab_parallel.lookup(embedding, labels.clamp(min=0))
        report[how] = {"loss": loss.tolist(), "grad": x.grad.flatten().tolist(), "lookup": found.flatten().tolist()}
    x = states.clone().requires_grad_(True)
    reference = torch.nn.functional.cross_entropy(x @ table.T, labels, ignore_index=IGNORE, reduction="none")
    reference.sum().backward()
    report["whole"] = {
        "loss": reference.tolist(),
        "grad": x.grad.flatten().tolist(),
        "lookup": table[labels.clamp(min=0)].flatten().tolist(),
    }
    try:  # a host size smaller than a rank's tokens: refused on the host, before any collective
        vocab_parallel.Loss(0).sized(3)(states, weight, labels)
    except RuntimeError as exc:
        report["too_small"] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def test_the_split_tables_collectives_sized_on_the_host_compute_what_they_did(tmp_path):
    """The split vocabulary asked every rank for its token count twice a micro-batch (an all-gather read
    on the host: a device sync on a GPU); the host knows it (data/batches.most_rows). Told it, the
    lookup and the loss give the asked version's values and gradients, which are the whole table's."""
    import torch.multiprocessing as mp
    from conftest import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_split_table_on_two_ranks, args=(r, port, str(tmp_path))) for r in range(2)]
    [p.start() for p in procs]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["told"] == report["asked"], rank  # the same collectives, the same padding: bit for bit
        for key in ("loss", "grad", "lookup"):
            torch.testing.assert_close(torch.tensor(report["told"][key]), torch.tensor(report["whole"][key]))
        assert "more than the 3" in report["too_small"]
