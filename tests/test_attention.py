"""Packed rows attend as their documents would alone, under every attention implementation
(raytrain decides the boundaries, attention.py; the rule is masks.py's).

The reference of each comparison is transformers itself on one document at a time (its own sdpa,
its own causal and sliding-window masks, nothing packed): a micro-batch of two rows, one starting
mid-document, several documents a row, padding at the end, must give every token the logits its
document gives alone. flash_attention_2 runs through transformers' own integration with flash-attn's
kernels in plain torch (tests/varlen.py), so its varlen kwargs are the ones a GPU gets; so does
sdpa on torch's varlen kernel ("sdpa varlen", what a GPU runs for sdpa in 16 bits: kernels.py), with a
reference of torch's calling convention in its place.
"""

from __future__ import annotations

import families
import pytest
import torch
import varlen

from raytrain.job import masks
from raytrain.model import attention, kernels

varlen.install()
IMPLEMENTATIONS = masks.IMPLEMENTATIONS
KERNELS = (*IMPLEMENTATIONS, kernels.VARLEN_NAME)  # what a worker may run: sdpa takes torch's varlen kernel on GPUs
S = 40
# Row 0 starts mid-document (positions 30..39 continue a document of the row before), then two
# documents; row 1 holds two documents and padding that continues the last one's positions.
POSITIONS = torch.tensor([list(range(30, 40)) + list(range(15)) + list(range(15)), list(range(25)) + list(range(15))])
SEGMENTS = [(0, 0, 10), (0, 10, 25), (0, 25, 40), (1, 0, 25), (1, 25, 40)]  # (row, start, end)


def models(assets) -> dict:
    """name -> config: the demo Llama, a Mistral with a sliding window of 6 on every layer, a Qwen2
    whose first layer is windowed and second is not, and the families whose attention modules are
    not Llama's (tests/families.py): Phi-3's fused projections, Gemma's head_dim, GPT-NeoX's
    multi-head attention without KV groups and partial rotary."""
    from transformers import AutoConfig, MistralConfig, Qwen2Config

    small = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    configs = {
        "llama": AutoConfig.from_pretrained(str(assets / "model")),
        "mistral window 6": MistralConfig(sliding_window=6, **small),
        "qwen2 window 6 on layer 1": Qwen2Config(
            use_sliding_window=True, sliding_window=6, max_window_layers=1, **small
        ),
    }
    return configs | {family: families.config(family, small) for family in ("phi3", "gemma", "gpt-neox")}


def build(config, implementation: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32)
    return model.eval()


def alone(config, ids: torch.Tensor) -> torch.Tensor:
    """Each document through transformers' own sdpa on its own: the logits every token should get."""
    model = build(config, "sdpa")
    out = torch.empty(*ids.shape, config.vocab_size)
    with torch.no_grad():
        for row, a, b in SEGMENTS:
            out[row, a:b] = model(input_ids=ids[row : row + 1, a:b], position_ids=POSITIONS[row : row + 1, a:b]).logits[
                0
            ]
    return out


@pytest.fixture(scope="module")
def cases(assets):
    ids = torch.randint(3, 380, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    return {name: (config, ids, alone(config, ids)) for name, config in models(assets).items()}


@pytest.fixture
def torch_varlen():
    varlen.install_torch_varlen()
    yield
    varlen.install_torch_varlen(False)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "model", ["llama", "mistral window 6", "qwen2 window 6 on layer 1", "phi3", "gemma", "gpt-neox"]
)
def test_packed_rows_attend_as_their_documents_alone(cases, model, kernel, request):
    config, ids, expected = cases[model]
    implementation = "sdpa" if kernel == kernels.VARLEN_NAME else kernel
    net = build(config, implementation)
    attention.install(net, implementation)
    boundaries = attention.Boundaries.of(POSITIONS)
    windows = masks.windows(config.to_dict(), S)
    assert boundaries.packed and len(windows) == (2 if model == "qwen2 window 6 on layer 1" else 1)
    if kernel == kernels.VARLEN_NAME:  # the worker's own choice, as a GPU makes it
        request.getfixturevalue("torch_varlen")
        assert kernels.attention_kernel("sdpa", torch.device("cpu"), torch.float32, config.to_dict(), windows) == kernel
    with torch.no_grad():
        kwargs = attention.model_kwargs(boundaries, kernel, windows, torch.device("cpu"), torch.float32)
        assert ("raytrain_masks" in kwargs) == (kernel in ("sdpa", "eager"))
        got = net(input_ids=ids, position_ids=POSITIONS, **kwargs).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_which_kernel_sdpa_runs(torch_varlen):
    """torch's varlen kernel where it runs for the device and dtype and the model asks nothing flash
    lacks; masks otherwise (and for eager and flash, their own)."""
    cpu, llama = torch.device("cpu"), {"hidden_size": 64, "num_attention_heads": 4}
    assert kernels.attention_kernel("sdpa", cpu, torch.float32, llama, (None, 8)) == kernels.VARLEN_NAME
    assert kernels.attention_kernel("eager", cpu, torch.float32, llama, (None,)) == "eager"
    assert kernels.attention_kernel("sdpa", cpu, torch.float16, llama, (None,)) == "sdpa"  # not a dtype it takes
    for asks in ({"attn_logit_softcapping": 50.0}, {"attention_dropout": 0.1}, {"head_dim": 12}, {"head_dim": 512}):
        assert kernels.attention_kernel("sdpa", cpu, torch.float32, llama | asks, (None,)) == "sdpa", asks
    varlen.install_torch_varlen(False)
    assert kernels.attention_kernel("sdpa", cpu, torch.float32, llama, (None,)) == "sdpa"  # no kernel on a CPU
    assert masks.mask_windows("sdpa", True, (None, 8), varlen=True) == ()


def test_transformers_own_flash_inference_gets_these_rows_wrong(cases):
    """Why raytrain passes the boundaries: given only the position ids, transformers' flash path
    treats a micro-batch of 2 as two unpacked rows (documents attend to each other), and in a row
    of its own leaves the tokens before the row's first 0 position out of every segment."""
    config, ids, expected = cases["llama"]
    net = build(config, "flash_attention_2")
    with torch.no_grad():
        both = net(input_ids=ids, position_ids=POSITIONS).logits
        row0 = net(input_ids=ids[:1], position_ids=POSITIONS[:1]).logits
    assert (both[1, 25:] - expected[1, 25:]).abs().max() > 1e-3  # row 1's second document saw its first
    assert (
        (row0[0, 10:25] - expected[0, 10:25]).abs().max() > 1e-3
        or not torch.isfinite(row0[0, :10]).all()
        or (row0[0, :10] - expected[0, :10]).abs().max() > 1e-3
    )


@pytest.mark.parametrize(
    "positions, packed, segments",
    [
        ([[0, 1, 2, 3, 4, 5]], False, [0, 6]),  # padding continues: one document
        ([[7, 8, 9, 0, 1, 2]], True, [0, 3, 6]),  # mid-document start, then a document
        ([[0, 1, 0, 0, 1, 2], [3, 4, 5, 6, 7, 8]], True, [0, 2, 3, 6, 12]),  # a one-token document; row 2 its own
    ],
)
def test_boundaries_follow_the_rule(positions, packed, segments):
    b = attention.Boundaries.of(torch.tensor(positions))
    cu, longest = b.varlen()
    assert b.packed == packed and cu.tolist() == segments and longest == max(torch.tensor(segments).diff().tolist())


def test_which_masks_each_implementation_gets():
    assert masks.mask_windows("flash_attention_2", True, (None, 8)) == ()
    assert masks.mask_windows("sdpa", False, (None,)) == ()  # one document a row: the causal kernel
    assert masks.mask_windows("sdpa", False, (None, 8)) == (8,)
    assert masks.mask_windows("sdpa", True, (None,)) == (None,)
    assert masks.mask_windows("eager", False, (None,)) == (None,)
    assert masks.windows({"sliding_window": 4096}, 4096) == (None,)  # a window as long as a row cuts nothing
    assert masks.windows({"sliding_window": 8, "use_sliding_window": False}, 64) == (None,)
    assert masks.windows({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, 64) == (None, 8)


def test_flash_on_a_worker_without_flash_attn_is_one_clear_error(assets, tmp_path, monkeypatch):
    """Without flash-attn (a CPU worker, an image without it), the job ends with the field and the fix,
    not transformers' ImportError from inside a worker."""
    from conftest import make_job
    from transformers.modeling_utils import PreTrainedModel

    from raytrain.errors import JobError
    from raytrain.model import modeling

    monkeypatch.setattr(PreTrainedModel, "_flash_attn_can_dispatch", varlen.dispatch_check())
    spec = make_job(assets, tmp_path, model={"attn_implementation": "flash_attention_2"})
    for on_meta in (False, True):
        with pytest.raises(
            JobError,
            match="model.attn_implementation flash_attention_2 cannot run on this worker .*"
            "use model.attn_implementation: sdpa",
        ):
            modeling.load_model(spec, on_meta=on_meta)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_plain_forward_of_a_raytrain_model_is_transformers_own(cases, implementation):
    """Outside training (an exported or loaded model, a probe) a forward without boundaries treats
    each row as one document, with the layers' windows: transformers' own result."""
    config, ids, _ = cases["mistral window 6"]
    plain, ours = build(config, implementation), build(config, implementation)
    attention.install(ours, implementation)
    with torch.no_grad():  # rows longer than the window, and rows it does not cut
        for rows in (ids, ids[:, :4]):
            torch.testing.assert_close(ours(input_ids=rows).logits, plain(input_ids=rows).logits, rtol=1e-5, atol=1e-5)


def test_the_varlen_kernel_is_resolved_once_where_the_worker_picks_it(torch_varlen):
    """Each attention call looked the kernel up (a functools.cache wrapper, inspect.signature and the
    device's capability: what a compiled block would trace); now it reads what attention_kernel,
    at setup, resolved. So a call finds it with no lookup able to: here, the table emptied after."""
    cpu, llama = torch.device("cpu"), {"hidden_size": 64, "num_attention_heads": 4}
    assert kernels.attention_kernel("sdpa", cpu, torch.float32, llama, (None,)) == kernels.VARLEN_NAME
    varlen.install_torch_varlen(False)  # nothing left to look up
    assert kernels.varlen_kernel(cpu, torch.float32) is None
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    out = kernels.varlen_attention(q, k, v, cu=cu, longest=8, groups=1, window=None, scale=None)
    # the first document of row 0 (positions 0..4) attends to itself alone, causally
    first = torch.nn.functional.scaled_dot_product_attention(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5], is_causal=True)
    torch.testing.assert_close(out[0, :5], first[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
