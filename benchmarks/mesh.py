"""L1-L3 (#26): what sequence and tensor parallelism buy, on 4 CPU ranks (gloo), measured with
the product's own strategy and step (`build_strategy`, `loop.train_step`) in one process group
per arm, arms run in turn by one command:

    python -m benchmarks.mesh [--quick]

L1  the longest sequence one step trains within a fixed per-rank memory cap (the step's peak
    resident memory above where it started: activations, logits, gradients, AdamW's state), the
    tiny demo model with sdpa, sp=4 / sp=1; found by doubling, then halving the gap to 256 tokens.
    Rows as the token store writes them: one document and padding (whose positions continue it), and
    packed rows under sdpa (a whole-rows s x s mask) and under flash_attention_2 (varlen boundaries)
    Also on the demo model with 4 KV heads: the demo's 2 are fewer than sp=4, so Ulysses repeats
    them (each rank needs one), which a Llama-shaped model (8 KV heads) does not need
L2  step time on the same tokens (4 sequences of --l2-seq tokens over 4 ranks), sp=2 / sp=1,
    median of the steps after the first
L3  a full fine-tune at tp=2 x dp=2 / dp=4: the step's peak per rank and the process's peak per
    rank (load + steps), for two Llama shapes (`L3_SHAPES`): one whose embeddings and head are most
    of it (tp replicates them over its ranks), one whose blocks are (tp halves what a gather holds)

Each arm is a fresh group of 4 processes (torch.multiprocessing, no Ray: this measures the
strategy, not the launcher). Figures go to benchmarks/RESULTS.md with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLD = 4


def _arm(rank: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "tests"))
    import mesh_cases

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if args.get("attn", "sdpa").startswith("flash"):  # flash-attn's kernels in torch (no GPU here)
        import varlen

        varlen.install()
    rows = mesh_cases.global_rows(False, args.get("packed", False), args["batch"], seq=args["seq"])
    spec = mesh_cases.job(
        args["model"],
        tempfile.mkdtemp(),
        sp=args.get("sp", 1),
        tp=args.get("tp", 1),
        finetune=args.get("finetune", "full"),
        seq=args["seq"],
        batch=args["batch"],
        attn=args.get("attn", "sdpa"),
    )
    times = []
    started = time.perf_counter()
    result = mesh_cases.run_case(spec, rows, steps=args["steps"], on_step=lambda: times.append(time.perf_counter()))
    steps = [b - a for a, b in zip([started, *times], times)]
    figures = {
        "step_peak_mb": result["step_peak_mb"],
        "process_peak_mb": mesh_cases._status_mb("VmHWM"),
        "step_s": steps,
        "loss": result["losses"][0],
    }
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    os._exit(0)  # the arm is done: no teardown of the group for another arm's timing to wait on


def run_arm(**args) -> list[dict]:
    """One group of 4 ranks; each rank's figures."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        mp.spawn(_arm, args=(_free_port(), args, out), nprocs=WORLD)
        return json.loads(Path(out).read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fits(model: str, sp: int, seq: int, cap_mb: float, **rows) -> tuple[bool, float]:
    ranks = run_arm(model=model, sp=sp, seq=seq, batch=WORLD // sp, steps=1, **rows)
    peak = max(r["step_peak_mb"] for r in ranks)
    return peak <= cap_mb, peak


def longest(model: str, sp: int, cap_mb: float, start: int, **rows) -> tuple[int, list]:
    """The longest sequence (a multiple of 256) whose step stays within the cap."""
    tried, seq, good, bad = [], start, 0, None
    while bad is None:
        ok, peak = fits(model, sp, seq, cap_mb, **rows)
        tried.append((seq, round(peak, 1)))
        good, bad, seq = (seq, None, seq * 2) if ok else (good, seq, seq)
    while bad - good > 256:
        mid = (good + bad) // 512 * 256
        ok, peak = fits(model, sp, mid, cap_mb, **rows)
        tried.append((mid, round(peak, 1)))
        good, bad = (mid, bad) if ok else (good, mid)
    return good, tried


def own_kv_heads(tiny: str, folder: Path) -> str:
    """The demo model with one KV head per attention head (4 and 4): at sp=4 each rank gets its own
    KV head, as Llama 3 8B's 8 KV heads do up to sp=8. The demo's 2 KV heads are repeated to 4."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (folder / "config.json").exists():
        config = AutoConfig.from_pretrained(tiny)
        config.num_key_value_heads = config.num_attention_heads
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return str(folder)


L3_SHAPES = {  # name: (vocab, hidden, MLP, layers); 16 heads, 4 KV heads
    "110M Llama shape (vocab 32000, hidden 1024, 4 layers: embeddings and head are 60%)": (32000, 1024, 2816, 4),
    "wide layers (hidden 2048, MLP 7168, 2 layers, vocab 384: blocks are 99%)": (384, 2048, 7168, 2),
}


def llama_shaped(folder: Path, vocab: int, hidden: int, mlp: int, layers: int) -> str:
    """A Llama of this shape (random weights, saved as safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=mlp,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return str(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="this 2-core machine's sizes (the defaults)")
    p.add_argument("--cap-mb", type=float, default=96.0, help="L1: the per-rank step memory cap")
    p.add_argument("--l2-seq", type=int, default=4096)
    p.add_argument("--l3-seq", type=int, default=512)
    p.add_argument("--only", default="l1,l2,l3")
    p.add_argument("--l1-only", default="", help="L1: only the arms whose label contains this")
    args = p.parse_args()
    from raytrain.demo_assets import make_all

    cache = REPO / "benchmarks" / ".cache"
    assets = make_all(cache / "assets")
    tiny = str(assets / "model")
    print(f"command: python -m benchmarks.mesh {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average {os.getloadavg()}")
    figures = {}
    if "l1" in args.only:
        for label, model, rows in (
            ("demo model, 4 heads, 2 KV heads", tiny, {}),
            ("4 heads, 4 KV heads", own_kv_heads(tiny, cache / "tiny-mha"), {}),
            ("packed rows (1-3 documents, often starting mid-document), sdpa", tiny, {"packed": True}),
            (
                "packed rows, flash_attention_2 (flash-attn's kernels in torch, tests/varlen.py)",
                tiny,
                {"packed": True, "attn": "flash_attention_2"},
            ),
        ):
            if args.l1_only and args.l1_only not in label:
                continue
            whole, tried1 = longest(model, 1, args.cap_mb, 1024, **rows)
            split, tried4 = longest(model, 4, args.cap_mb, 4096, **rows)
            figures.setdefault("l1", {})[label] = {
                "sp1": whole,
                "sp4": split,
                "ratio": split / whole,
                "tried_sp1": tried1,
                "tried_sp4": tried4,
            }
            print(
                f"L1 ({label}) longest sequence within {args.cap_mb:g} MiB of step memory a rank: sp=4 {split} "
                f"tokens / sp=1 {whole} tokens = ratio {split / whole:.2f} (tried: sp=1 {tried1}; sp=4 {tried4})",
                flush=True,
            )
    if "l2" in args.only:
        arms = {}
        for sp in (1, 2, 1, 2):  # alternated
            ranks = run_arm(model=tiny, sp=sp, seq=args.l2_seq, batch=WORLD, steps=6)
            arms.setdefault(sp, []).extend(statistics.median(r["step_s"][1:]) for r in ranks[:1])
        one, two = statistics.median(arms[1]), statistics.median(arms[2])
        figures["l2"] = {"sp1_s": arms[1], "sp2_s": arms[2], "ratio": two / one}
        print(
            f"L2 step time, {WORLD} sequences of {args.l2_seq} tokens on {WORLD} ranks: sp=2 median {two:.3f} s / "
            f"sp=1 median {one:.3f} s = ratio {two / one:.2f}"
        )
    if "l3" in args.only:
        for label, shape in L3_SHAPES.items():
            model = llama_shaped(cache / ("llama-" + "-".join(map(str, shape))), *shape)
            arms = {}
            for tp in (1, 2):
                ranks = run_arm(model=model, tp=tp, seq=args.l3_seq, batch=WORLD, steps=2)
                arms[tp] = {
                    "step_peak_mb": max(r["step_peak_mb"] for r in ranks),
                    "process_peak_mb": max(r["process_peak_mb"] for r in ranks),
                    "loss": ranks[0]["loss"],
                }
            l3 = {
                "dp4": arms[1],
                "tp2_dp2": arms[2],
                "step_ratio": arms[2]["step_peak_mb"] / arms[1]["step_peak_mb"],
                "process_ratio": arms[2]["process_peak_mb"] / arms[1]["process_peak_mb"],
            }
            figures.setdefault("l3", {})[label] = l3
            print(
                f"L3 full fine-tune, {label}, {args.l3_seq} tokens a rank: step peak a rank tp=2 x dp=2 "
                f"{arms[2]['step_peak_mb']:.0f} MiB / dp=4 {arms[1]['step_peak_mb']:.0f} MiB = ratio "
                f"{l3['step_ratio']:.2f}; process peak {arms[2]['process_peak_mb']:.0f} / "
                f"{arms[1]['process_peak_mb']:.0f} MiB = ratio {l3['process_ratio']:.2f}; "
                f"first losses {arms[2]['loss']:.6f} / {arms[1]['loss']:.6f}",
                flush=True,
            )
    print("FIGURES " + json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
