"""The rollout engine's own process: vLLM in its own Python environment (vLLM pins its own
transformers and torch builds, which move on vLLM's schedule, not raytrain's), driven by one
training worker (rl/engine.py) over a pipe of JSON lines.

Run by path with that environment's Python; it imports nothing of raytrain but `private_apis`
(the one place private APIs live), which imports only the standard library at module level.
Each request is one line; each answer one line, `{"error": ...}` when the request failed, so the
worker raises it with the engine's own words. Weights and adapters arrive as safetensors files the
worker wrote (never pickles: nothing read here runs code). A full sync is one `reload_weights` fed
a file at a time (`_streamed`): each file is read, deleted and acknowledged before the worker
writes the next, so the shared-memory folder holds about one file, not the model.

The engine sets its own death signal (PR_SET_PDEATHSIG) at its start, then checks that its parent
is still the worker that started it: the worker starts it without a preexec_fn, which would run
Python between fork and exec in a threaded process.

Sampling: each completion carries its own seed (rl/sampling.completion_key), so what vLLM samples
is a function of (key, prompt, weights), not of the order requests arrive in. Prefix caching is
off: a cache hit computes a prompt's keys by another path than a miss, and a resumed run's cache
is empty where the uninterrupted run's was warm."""

from __future__ import annotations

import json
import os
import sys
import time


def _engine(args: dict):
    from vllm import LLM

    sizing = (
        {"kv_cache_memory_bytes": args["kv_cache_bytes"]}
        if args.get("kv_cache_bytes")
        else {"gpu_memory_utilization": args["gpu_memory_utilization"]}
    )
    lora = {"enable_lora": True, "max_lora_rank": args["lora_rank"], "max_loras": 1} if args.get("lora_rank") else {}
    return LLM(
        model=args["model"],
        revision=args.get("revision"),  # the trainer's pinned commit: a moved hub id must not change the base
        dtype=args["dtype"],
        seed=0,
        enforce_eager=args["enforce_eager"],
        max_model_len=args["max_model_len"],
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",  # after temperature and top_p: the distribution sampled
        trust_remote_code=False,
        **sizing,
        **lora,
    )


def _generate(llm, lora, req: dict) -> dict:
    from vllm import SamplingParams

    limits = req["max_tokens"] if isinstance(req["max_tokens"], list) else [req["max_tokens"]] * len(req["keys"])
    params = [
        SamplingParams(
            n=1,
            max_tokens=limit,
            temperature=req["temperature"],
            top_p=req["top_p"],
            seed=key,
            logprobs=0,
            stop_token_ids=req["eos"],
            detokenize=False,
        )
        for key, limit in zip(req["keys"], limits)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, lora_request=lora, use_tqdm=False)
    completions, logps = [], []
    for out, sent in zip(outs, req["prompts"]):
        if list(out.prompt_token_ids) != sent:  # the trainer's tokens are the engine's: nothing re-tokenized
            raise ValueError("the engine's prompt tokens differ from those the trainer sent")
        sample = out.outputs[0]
        completions.append(list(sample.token_ids))
        logps.append([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
    return {"completions": completions, "logps": logps}


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the worker's spawning thread ends; gone already (between its spawn and here): exit."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


def _streamed(answer):
    """The weights of the files the worker sends, one {"file": path} line each, until {"end": true}:
    each file read, deleted and acknowledged ({"taken": path}) before the worker writes the next."""
    from safetensors.torch import load_file

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("end"):
            return
        tensors = load_file(req["file"])
        os.unlink(req["file"])
        answer.write(json.dumps({"taken": req["file"]}) + "\n")
        yield from tensors.items()


def main() -> None:
    args = json.loads(sys.argv[1])
    _die_with_parent(args["parent"])
    # Run by path, Python put this file's folder (raytrain/rl/) first on sys.path, where raytrain's own
    # modules would shadow top-level packages of the same name (transformers imports `kernels`, the
    # Hub's kernels package, when one is importable, and once found raytrain's). Only the package root.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, args["raytrain_root"])
    from raytrain import private_apis

    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to the engine's log, never into the protocol
    # The engine in this one process (no engine-core child): it dies with the worker's death signal,
    # and a post-load call reaches its model without pickling a function across processes.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    started = time.perf_counter()
    llm, lora = _engine(args), None
    import vllm

    answer.write(json.dumps({"ready": time.perf_counter() - started, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "generate":
                out = _generate(llm, lora, req)
            elif req["op"] == "adapter":  # a new id each sync: vLLM caches adapters by id
                from vllm.lora.request import LoRARequest

                lora, out = LoRARequest(f"step-{req['id']}", req["id"], req["path"]), {}
            elif req["op"] == "weights":
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _streamed(answer)})
                private_apis.vllm_refresh_tied_output_layer(llm)
                out = {}
            elif req["op"] == "quit":
                break
            else:
                out = {"error": f"unknown request {req['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - the worker raises it with the engine's words
            out = {"error": f"{type(exc).__name__}: {exc}"}
        answer.write(json.dumps(out) + "\n")


if __name__ == "__main__":  # vLLM may spawn helpers that re-import the main module
    main()
