"""`raytrain validate` on bad jobs and bad datasets: the real CLI in a subprocess, as a
user or a CI script runs it (the parametrized bad jobs call its `main` in this process).
Each bad job exits 2 and names the field (or file and row) on a problem line of its own;
nothing prints a traceback; valid jobs exit 0.

Plus the `--json` shape, "never imports torch", and unit tests of the memory estimate
against what torch and peft count on the demo model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import KNOWN_CONFIGS, REPO, free_port, hub_cache

LLAMA_31_8B = KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]


def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", *args],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr


def cli_here(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    """The CLI's own `main` in this process: the same parser, checks and messages as the command, without an
    interpreter's start a case (about 0.7 s each, for the ~90 bad jobs below). The command's process (exit
    code, no traceback, no torch) is the subprocess tests' (`cli`)."""
    import contextlib
    import io

    from raytrain import cli as raytrain_cli

    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = raytrain_cli.main(list(args))
            except SystemExit as stop:  # argparse's own refusals
                code = stop.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def base_job(assets: Path, tmp: Path) -> dict:
    return {
        "name": "t",
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "text.jsonl"), "seq_len": 32},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 5, "lora": {"rank": 4, "alpha": 8}},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp / "runs")},
        "tracking": {"experiment": "tests"},
    }


def write_job(tmp: Path, job: dict | str, name: str = "job.yaml") -> Path:
    path = tmp / name
    path.write_text(job if isinstance(job, str) else yaml.safe_dump(job, sort_keys=False))
    return path


def copy_model(assets: Path, tmp: Path, drop: tuple = (), **config) -> str:
    out = tmp / "model"
    shutil.copytree(assets / "model", out)
    for name in drop:
        (out / name).unlink()
    if config:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(out)


def lines(tmp: Path, rows: list, name: str = "d.jsonl") -> str:
    (tmp / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(tmp / name)


CHAT_OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

# ---------------------------------------------------------------- the bad jobs
# Each case edits a valid job (and may write files); it returns extra CLI args or a YAML
# text to use instead. `field` must lead a problem line, `text` must be on that line.
CASES: dict = {}


def case(field: str, text: str):
    def register(fn):
        CASES[fn.__name__] = (fn, field, text)
        return fn

    return register


@case("(job file)", "no such file")
def job_file_missing(job, tmp, assets):
    return {"path": tmp / "nope.yaml"}


@case("(job file)", "not valid YAML at line 3")
def yaml_syntax_error(job, tmp, assets):
    return {"text": "name: t\nmodel: [unclosed\n"}


@case("(job file)", "a job is a YAML mapping")
def job_is_a_list(job, tmp, assets):
    return {"text": "- name: t\n"}


@case("training", "appears twice")
def duplicate_section(job, tmp, assets):
    return {"text": yaml.safe_dump(job, sort_keys=False) + "training:\n  max_steps: 3\n"}


@case("data.seq_len", "valid integer")
def override_with_bad_value(job, tmp, assets):
    return {"args": ["--set", "data.seq_len=long"]}


@case("--set", "expected KEY.PATH=VALUE")
def override_without_value(job, tmp, assets):
    return {"args": ["--set", "training.max_steps"]}


@case("trainng", "did you mean 'training'?")
def unknown_section(job, tmp, assets):
    job["trainng"] = job.pop("training")


@case("training.max_step", "did you mean 'max_steps'?")
def unknown_nested_key(job, tmp, assets):
    job["training"]["max_step"] = 10


@case("training.strategy", "use one of 'fsdp2', 'zero3' or 'ddp'")
def unknown_strategy(job, tmp, assets):
    job["training"]["strategy"] = "fsdp"


@case("data.format", "use one of 'text', 'chat', 'alpaca', 'sharegpt' or 'prompt'")
def unknown_data_format(job, tmp, assets):
    job["data"]["format"] = "openai"


@case("optimizer.lr", "greater than 0")
def zero_learning_rate(job, tmp, assets):
    job["optimizer"] = {"lr": 0}


@case("training.lora.dropout", "less than 1")
def lora_dropout_one(job, tmp, assets):
    job["training"]["lora"]["dropout"] = 1.0


@case("training.max_steps", "valid integer")
def steps_not_a_number(job, tmp, assets):
    job["training"]["max_steps"] = "ten"


@case("data", "required and missing")
def data_section_missing(job, tmp, assets):
    del job["data"]


@case("model.path", "required and missing")
def model_path_missing(job, tmp, assets):
    job["model"] = {"dtype": "bfloat16"}


@case("training", "expected a section")
def section_not_a_mapping(job, tmp, assets):
    job["training"] = 5


@case("name", "use letters, digits")
def bad_name(job, tmp, assets):
    job["name"] = "my job!"


@case("training.global_batch_size = 1", "some ranks would get no rows; use global_batch_size >= 2")
def batch_smaller_than_the_workers(job, tmp, assets):
    job["training"]["global_batch_size"] = 1


@case("training.global_batch_size = 8", "the 16 workers the job may run with")
def elastic_range_beyond_the_batch(job, tmp, assets):
    job["scaling"] = {"min_workers": 2, "max_workers": 16}


@case("training.deepspeed", "only used by strategy zero3")
def deepspeed_block_under_fsdp2(job, tmp, assets):
    job["training"]["deepspeed"] = {"zero_optimization": {"stage": 3}}


@case("scaling.num_workers = 2", "not both")
def fixed_and_elastic_workers(job, tmp, assets):
    job["scaling"] = {"num_workers": 2, "min_workers": 1, "max_workers": 4}


@case("scaling.min_workers = 4", "swap them")
def min_workers_above_max(job, tmp, assets):
    job["scaling"] = {"min_workers": 4, "max_workers": 2}


@case("training.offload", "fsdp2 and zero3 only")
def offload_under_ddp(job, tmp, assets):
    job["training"].update(strategy="ddp", offload={"optimizer": True})


@case("model.dtype = float16", "use model.dtype: bfloat16")
def fp16_full_finetune(job, tmp, assets):
    job["model"]["dtype"] = "float16"
    job["training"]["finetune"] = "full"


@case("model.hf_token = <redacted>", "environment variable")
def token_in_job(job, tmp, assets):
    job["model"]["hf_token"] = "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"


@case("training.deepspeed.aws = <redacted>", "looks like a secret")
def token_shaped_value(job, tmp, assets):
    job["training"].update(strategy="zero3", deepspeed={"aws": "AKIAIOSFODNN7EXAMPLE"})


@case("tracking.uri = <redacted>", "password in a URI")
def password_in_tracking_uri(job, tmp, assets):
    job["tracking"]["uri"] = "http://alice:s3cret@127.0.0.1:5000"


@case("model.trust_remote_code = false", "ships its own")
def remote_code_not_explicit(job, tmp, assets):
    job["model"]["path"] = copy_model(assets, tmp, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})


@case("model.path", "no such folder, and not a hub id")
def model_folder_missing(job, tmp, assets):
    job["model"]["path"] = "./models/nope"


@case("model.path", "has no config.json")
def model_folder_without_config(job, tmp, assets):
    (tmp / "empty").mkdir()
    job["model"]["path"] = str(tmp / "empty")


@case("model.path", "is not a causal LM")
def masked_lm(job, tmp, assets):
    job["model"]["path"] = copy_model(assets, tmp, architectures=["BertForMaskedLM"])


@case("model.path", "cannot read the model's config")
def config_not_json(job, tmp, assets):
    job["model"]["path"] = copy_model(assets, tmp)
    (tmp / "model" / "config.json").write_text("{not json")


@case("training.lora.target_modules = 'q_porj'", "did you mean 'q_proj'?")
def lora_target_typo(job, tmp, assets):
    job["training"]["lora"]["target_modules"] = ["q_proj", "q_porj"]


@case("data.seq_len = 4096", "context window (2048)")
def seq_len_over_window(job, tmp, assets):
    job["data"]["seq_len"] = 4096


@case("model.tokenizer", "no tokenizer files")
def model_without_tokenizer(job, tmp, assets):
    job["model"]["path"] = copy_model(assets, tmp, drop=("tokenizer.json", "tokenizer_config.json"))


@case("data.format = 'chat'", "rendered with the tokenizer's chat template")
def chat_without_template(job, tmp, assets):
    job["model"]["path"] = copy_model(assets, tmp, drop=("chat_template.jinja",))
    job["data"].update(path=str(assets / "chat.jsonl"), format="chat", seq_len=48)


@case("scaling.accelerator_memory_gb = 0.7713", "smallest change that fits: training.")
def does_not_fit(job, tmp, assets):
    # GiB: a CPU worker's process is ~0.77 GiB before the demo model's ~1.5 MiB
    job["scaling"]["accelerator_memory_gb"] = 0.7713


@case("data.path", "no such file or folder")
def data_missing(job, tmp, assets):
    job["data"]["path"] = str(tmp / "nope.jsonl")


@case("data.path", "no .jsonl, .json, .parquet files")
def data_folder_of_csv(job, tmp, assets):
    (tmp / "csv").mkdir()
    (tmp / "csv" / "a.csv").write_text("text\nhello\n")
    job["data"]["path"] = str(tmp / "csv")


@case("data.columns.text = 'text'", "columns there: content")
def text_column_missing(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{"content": "a fox"}] * 5)


@case("data.columns.messages = 'messages'", "set data.format: text")
def chat_format_on_text_data(job, tmp, assets):
    job["data"]["format"] = "chat"


@case(
    "data.tags.role_tag = 'from'",
    "keys there: content, role); set data.tags.role_tag (these are chat keys: set data.format: chat)",
)
def sharegpt_format_on_openai_messages(job, tmp, assets):
    job["data"].update(path=lines(tmp, [{"conversations": CHAT_OK["messages"]}] * 3), format="sharegpt")


@case(
    "tracking.uri = null",
    "the default MLflow store is a sqlite file, which the job's processes on other nodes cannot share",
)
def remote_checkpoints_without_a_tracking_server(job, tmp, assets):
    job["checkpoint"]["storage_path"] = "s3://my-bucket/runs"


@case("data", "give data.path (one dataset) or data.sources (a blend), exactly one of them")
def both_path_and_sources(job, tmp, assets):
    job["data"]["sources"] = [{"path": job["data"]["path"], "weight": 1}]


@case("data.eval", "either `path` (its own data) or `fraction`")
def eval_with_neither(job, tmp, assets):
    job["data"]["eval"] = {"every_n_steps": 10}


@case("data.sources[1].path", "no such file or folder")
def blend_with_a_missing_source(job, tmp, assets):
    job["data"] = {"sources": [{"path": job["data"]["path"]}, {"path": str(tmp / "nope.jsonl")}], "seq_len": 32}


@case("data.columns.response = 'output'", "columns there: answer, instruction")
def alpaca_without_output(job, tmp, assets):
    job["data"].update(path=lines(tmp, [{"instruction": "say hi", "answer": "hi"}] * 3), format="alpaca")


@case(
    "data.bad_rows = 'fail'",
    "d.jsonl row 3: turn 1 must be {role: one of ['assistant', 'function_call', 'system', 'tool', 'user']",
)
def invalid_chat_role(job, tmp, assets):
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}
    job["data"].update(path=lines(tmp, [CHAT_OK, CHAT_OK, bad, CHAT_OK]), format="chat", bad_rows="fail")


@case("data.bad_rows = 'fail'", "d.jsonl row 2: column 'text' must be a string, got int")
def text_of_wrong_type(job, tmp, assets):
    job["data"].update(path=lines(tmp, [{"text": "a"}, {"text": 5}, {"text": "b"}]), bad_rows="fail")


@case("data.bad_rows = 'fail'", "d.jsonl row 2: empty line")
def empty_line(job, tmp, assets):
    job["data"].update(path=lines(tmp, [{"text": "a"}, "", {"text": "b"}]), bad_rows="fail")


@case("data.path", "row 1: not valid JSON")
def csv_named_jsonl(job, tmp, assets):
    job["data"]["path"] = lines(tmp, ["text,label", "a fox,1"])


@case("data.path", "hold no rows")
def empty_data_file(job, tmp, assets):
    (tmp / "empty.jsonl").write_text("")
    job["data"]["path"] = str(tmp / "empty.jsonl")


@case("data.path", "not UTF-8")
def data_not_utf8(job, tmp, assets):
    (tmp / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    job["data"]["path"] = str(tmp / "latin.jsonl")


@case("data.columns.text = 'text'", "columns there: body")
def parquet_without_column(job, tmp, assets):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a fox", "a dog"]}), tmp / "d.parquet")
    job["data"]["path"] = str(tmp / "d.parquet")


@case("checkpoint.storage_path", "not writable")
def storage_under_a_file(job, tmp, assets):
    (tmp / "file").write_text("x")
    job["checkpoint"]["storage_path"] = str(tmp / "file" / "runs")


@case("tracking.uri", "no MLflow server answers")
def mlflow_not_listening(job, tmp, assets):
    job["tracking"]["uri"] = f"http://127.0.0.1:{free_port()}"


@case("tracking.uri", "refuses file stores")
def mlflow_file_store(job, tmp, assets):
    job["tracking"]["uri"] = f"file://{tmp}/mlruns"


@case("tracking.uri", "needs a writable folder")
def sqlite_under_a_file(job, tmp, assets):
    (tmp / "file").write_text("x")
    job["tracking"]["uri"] = f"sqlite:///{tmp}/file/mlflow.db"


@case("training.offload.optimizer", "fsdp2 offloads parameters, gradients and optimizer state together")
def fsdp2_offloading_the_optimizer_alone(job, tmp, assets):
    job["training"].update(strategy="fsdp2", offload={"optimizer": True})


@case("training.gradient_sync = 'last_micro_batch'", "ZeRO-3 reduce-scatters every micro-batch")
def zero3_asked_to_keep_whole_gradients(job, tmp, assets):
    job["training"].update(strategy="zero3", gradient_sync="last_micro_batch")


@case("scaling.hsdp", "ZeRO-3's equivalent is training.deepspeed: {zero_optimization: {zero_hpz_partition_size")
def hsdp_asked_of_zero3(job, tmp, assets):
    job["training"]["strategy"] = "zero3"
    job["scaling"]["hsdp"] = True


@case("scaling.hsdp", "set scaling.workers_per_node to the training workers of one node")
def hsdp_without_nodes(job, tmp, assets):
    job["scaling"]["hsdp"] = True


@case("training.compile = true", "ZeRO-3's parameter hooks break compiled graphs")
def compile_asked_of_zero3(job, tmp, assets):
    job["training"].update(strategy="zero3", compile=True)


@case("training.chunked_loss = true", "ZeRO-3 has partitioned it again by then")
def chunked_loss_asked_of_zero3(job, tmp, assets):
    job["training"].update(strategy="zero3", chunked_loss=True)


PAIR_OK = {"prompt": "the red fox", "chosen": " jumps.", "rejected": " runs."}


@case("data.columns.rejected = 'rejected'", "columns there: chosen, prompt, worse")
def preference_rows_without_rejected(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{"prompt": "the fox", "chosen": " jumps.", "worse": " runs."}] * 3)
    job["training"]["objective"] = "dpo"


@case(
    "data.columns.text = 'text'", "these rows are preference pairs: set training.objective: dpo (or simpo, or reward)"
)
def preference_rows_trained_as_sft(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [PAIR_OK] * 3)


@case("data.columns.prompt = 'prompt'", "no such column in the first 3 rows (columns there: text)")
def reward_model_on_unpaired_rows(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{"text": "the red fox jumps."}] * 3)
    job["training"]["objective"] = "reward"


@case("data.bad_rows = 'fail'", "column 'margin' (the pair's margin) must be a finite number, got 'high'")
def reward_margin_not_a_number(job, tmp, assets):
    job["data"].update(
        path=lines(tmp, [PAIR_OK, {**PAIR_OK, "margin": "high"}, {**PAIR_OK, "margin": 0.5}]), bad_rows="fail"
    )
    job["training"]["objective"] = "reward"


@case("data.columns.label = 'label'", "no such column in the first 3 rows (columns there: completion, prompt)")
def kto_rows_without_labels(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{"prompt": "the fox", "completion": " jumps."}] * 3)
    job["training"]["objective"] = "kto"


@case("data.path", "usable as text unpaired feedback data, e.g. ")
def kto_label_not_a_boolean(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{"prompt": "the fox", "completion": " jumps.", "label": "yes"}] * 3)
    job["training"]["objective"] = "kto"


@case("training.preference.loss = 'apo_zero_unpaired'", "is KTO's unpaired loss, and training.objective is dpo")
def kto_loss_asked_of_dpo(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [PAIR_OK] * 3)
    job["training"].update(objective="dpo", preference={"loss": "apo_zero_unpaired"})


@case("training.preference.center_rewards_coefficient", "set training.objective: reward")
def centred_rewards_asked_of_dpo(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [PAIR_OK] * 3)
    job["training"].update(objective="dpo", preference={"center_rewards_coefficient": 0.01})


@case("data.train_on_inputs", "a preference pair's prompt is never trained")
def preference_with_train_on_inputs(job, tmp, assets):
    job["data"].update(path=lines(tmp, [PAIR_OK] * 3), train_on_inputs=True)
    job["training"]["objective"] = "dpo"


@case("training.preference.loss", "is a DPO loss; simpo has its own")
def simpo_with_a_dpo_loss(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [PAIR_OK] * 3)
    job["training"].update(objective="simpo", preference={"loss": "ipo"})


@case("data.path", "usable as text preference data, e.g. ")
def preference_prompt_not_a_string(job, tmp, assets):
    job["data"]["path"] = lines(tmp, [{**PAIR_OK, "prompt": ["the fox"]}] * 3)
    job["training"]["objective"] = "dpo"


@case("scaling.sequence_parallel", "set training.strategy: fsdp2")
def sequence_parallel_asked_of_zero3(job, tmp, assets):
    job["training"]["strategy"] = "zero3"
    job["scaling"]["sequence_parallel"] = 2


@case("scaling.tensor_parallel", "composes with fsdp2")
def tensor_parallel_asked_of_ddp(job, tmp, assets):
    job["training"]["strategy"] = "ddp"
    job["scaling"]["tensor_parallel"] = 2


@case(
    "data.seq_len",
    "not divisible by scaling.sequence_parallel=3: each rank takes an equal part of a sequence; use seq_len 30 or 33",
)
def seq_len_not_split_evenly(job, tmp, assets):
    job["data"]["seq_len"] = 32
    job["scaling"].update(num_workers=3, sequence_parallel=3)


@case("scaling", "does not divide the worker count(s) [2]: use multiples of 4")
def workers_not_whole_groups(job, tmp, assets):
    job["scaling"].update(sequence_parallel=2, tensor_parallel=2)


@case("scaling", "a sequence's ranks must share a node")
def group_spans_nodes(job, tmp, assets):
    job["scaling"].update(num_workers=12, workers_per_node=6, sequence_parallel=4)
    job["training"]["global_batch_size"] = 12


@case("scaling", "must grow and shrink by whole groups")
def elastic_without_whole_groups(job, tmp, assets):
    job["scaling"] = {"min_workers": 2, "max_workers": 4, "sequence_parallel": 2}


@case("scaling.sequence_parallel", "4 attention heads per tensor-parallel rank are not divisible by 3")
def heads_not_split_evenly(job, tmp, assets):  # the demo model: 4 heads, 2 KV heads
    job["data"]["seq_len"] = 33
    job["scaling"].update(num_workers=3, sequence_parallel=3)


@case("training.finetune", "ZeRO-3 flattens parameters into its own partitions")
def qlora_under_zero3(job, tmp, assets):
    job["training"].update(finetune="qlora", strategy="zero3")


@case("training.finetune = qlora", "cannot be sharded by whole rows over 3 workers")
def qlora_weights_do_not_split_over_the_workers(job, tmp, assets):
    job["training"]["finetune"] = "qlora"
    job["scaling"]["num_workers"] = 3


@case("scaling.tensor_parallel", "num_key_value_heads=2 is not divisible by 4")
def kv_heads_not_split_evenly(job, tmp, assets):
    job["scaling"].update(num_workers=4, tensor_parallel=4)


GRPO = {
    "objective": "grpo",
    "grpo": {
        "num_generations": 2,
        "max_completion_length": 8,
        "rewards": [{"builtin": "accuracy", "column": "solution"}],
    },
}


def grpo_job(job, tmp, **grpo):
    job["data"].update(path=lines(tmp, [{"prompt": "the red fox", "solution": "jumps"}] * 3), format="prompt")
    job["training"].update({**GRPO, "grpo": {**GRPO["grpo"], **grpo}})


@case("training.objective", "needs training.grpo.rewards")
def grpo_without_rewards(job, tmp, assets):
    grpo_job(job, tmp, rewards=[])


@case("training.grpo.loss_type", "set training.grpo.epsilon_high (CISPO's paper and TRL recommend 5.0)")
def grpo_cispo_without_its_bound(job, tmp, assets):
    grpo_job(job, tmp, loss_type="cispo")


@case("training.grpo.engine", "vLLM's CPU attention takes head sizes [32, 64")
def grpo_on_vllm_with_a_head_size_it_cannot_run(job, tmp, assets):
    grpo_job(job, tmp, engine="vllm")  # the demo model: head_dim 16


@case("training.grpo.engine", "architecture MadeUpForCausalLM is not one the tested vLLM (0.32) runs")
def grpo_on_vllm_with_an_architecture_it_lacks(job, tmp, assets):
    grpo_job(job, tmp, engine="vllm")
    job["model"]["path"] = copy_model(assets, tmp, architectures=["MadeUpForCausalLM"])


@case("training.grpo.engine", "there is none at /nowhere/bin/python on this machine: run `bash cluster/setup-local.sh`")
def grpo_on_vllm_without_its_environment(job, tmp, assets):
    grpo_job(job, tmp, engine="vllm")
    job["model"]["path"] = str(assets / "model-hd64")
    return {"env": {"RAYTRAIN_VLLM_PYTHON": "/nowhere/bin/python"}}


@case("training.grpo.vllm_importance_sampling_mode", "a setting of engine: vllm, and training.grpo.engine is hf")
def grpo_vllm_setting_without_vllm(job, tmp, assets):
    grpo_job(job, tmp, vllm_importance_sampling_mode="token_mask")


@case("training.grpo.engine", "vLLM serves LoRA adapters, not DoRA's magnitudes")
def grpo_on_vllm_with_dora(job, tmp, assets):
    grpo_job(job, tmp, engine="vllm")
    job["model"]["path"] = str(assets / "model-hd64")
    job["training"]["lora"] = {"use_dora": True}


@case("training.objective", "rollouts decode one token at a time with a KV cache")
def grpo_with_sequence_parallelism(job, tmp, assets):
    grpo_job(job, tmp)
    job["scaling"]["sequence_parallel"] = 2


@case("model.attn_implementation", "the rollout's decode (left-padded prompts, a KV cache) is not verified")
def grpo_with_flash_attention(job, tmp, assets):
    grpo_job(job, tmp)
    job["model"]["attn_implementation"] = "flash_attention_2"


@case("data.format", "is GRPO's (prompts the workers complete), and training.objective is sft")
def prompt_rows_for_sft(job, tmp, assets):
    job["data"].update(path=lines(tmp, [{"prompt": "the red fox"}] * 3), format="prompt")


@case("data.format", "text: GRPO reads prompts; set data.format: prompt")
def grpo_on_text_rows(job, tmp, assets):
    grpo_job(job, tmp)
    job["data"]["format"] = "text"


@case("training.grpo.rewards[0].function", "no module 'my_rewards_nowhere' here")
def grpo_reward_module_missing(job, tmp, assets):
    grpo_job(job, tmp, rewards=[{"function": "my_rewards_nowhere:brevity"}])


@case("training.grpo.rewards[0].model", "no such folder, and not a hub id")
def grpo_reward_model_missing(job, tmp, assets):
    grpo_job(job, tmp, rewards=[{"model": str(tmp / "no-rm")}])


@case("training.grpo.rewards[0].model", "has no *.safetensors: only safetensors weights are read")
def grpo_reward_model_pickled(job, tmp, assets):
    folder = tmp / "rm"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"pickled")
    grpo_job(job, tmp, rewards=[{"model": str(folder)}])


@case("training.grpo.rewards[0].model", "holds no scoring head (no score.weight in its safetensors): it is a causal LM")
def grpo_reward_model_without_a_head(job, tmp, assets):  # transformers would make up a random head on each rank
    grpo_job(job, tmp, rewards=[{"model": str(assets / "model")}])


@case("training.grpo.rewards[0].model", "is a hub id: a reward model is read from a folder")
def grpo_reward_model_from_the_hub(job, tmp, assets):
    grpo_job(job, tmp, rewards=[{"model": "OpenAssistant/reward-model-deberta-v3-large-v2"}])


@case("training.grpo.rewards[0].model", "its scoring head has 3 labels (score.weight)")
def grpo_reward_model_of_three_labels(job, tmp, assets):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(str(assets / "model"), num_labels=3).save_pretrained(
        str(tmp / "rm3")
    )
    grpo_job(job, tmp, rewards=[{"model": str(tmp / "rm3")}])


@case("training.grpo.rewards.0", "set `column`")
def grpo_accuracy_without_a_column(job, tmp, assets):
    grpo_job(job, tmp, rewards=[{"builtin": "accuracy"}])


@case("data.columns.prompt", "no such column in the first 3 rows")
def grpo_rows_without_a_prompt(job, tmp, assets):
    grpo_job(job, tmp)
    job["data"]["path"] = lines(tmp, [{"question": "the red fox", "solution": "jumps"}] * 3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_job_exits_2_naming_the_field(name, assets, tmp_path):
    fn, field, text = CASES[name]
    job = base_job(assets, tmp_path)
    extra = fn(job, tmp_path, assets) or {}
    path = extra.get("path") or write_job(tmp_path, extra.get("text", job))
    code, out, err = cli_here("validate", str(path), *extra.get("args", []), env=extra.get("env"))
    assert code == 2, out + err
    problem_lines = [ln for ln in err.splitlines() if ln.startswith(f"  - {field}")]
    assert any(text in ln for ln in problem_lines), err
    assert "Traceback" not in out + err


# ---------------------------------------------------------------- valid jobs, --json, every problem at once
def test_valid_job_exits_0_and_shows_the_memory_arithmetic(assets, tmp_path):
    code, out, err = cli("validate", str(write_job(tmp_path, base_job(assets, tmp_path))))
    assert code == 0, err
    assert (
        "valid (fsdp2, lora, workers 2..2, accumulation 2..2; survives 3 worker failures, preemptions not counted)"
        in out
    )
    memory_note = next(ln for ln in err.splitlines() if ln.startswith("  note: scaling.accelerator_memory_gb"))
    assert (
        "frozen weights 4 B × 123K params / 2" in memory_note and "safetensors headers" in memory_note
    )  # tied: one table
    # fsdp2 keeps a LoRA job's frozen output layer apart from its units (no gathered root unit). Split
    # by rows it would cost this tiny model's ranks more (every rank's gathered hidden states and their
    # gradient, 2 × 64·64 × 8 B) than the other rank's rows it saves (384·64 × 4 B / 2): kept whole
    # (plan.splits_vocabulary; test_plan.py has the sizes where the split pays).
    assert "frozen output layer (tied to the embedding) whole on every rank 384·64 × 4 B × (1 - 1/2)" in memory_note
    assert "split by rows" not in memory_note
    assert "gathered unit" not in memory_note
    assert "Traceback" not in out + err


def test_json_lists_problems_with_field_value_message(assets, tmp_path):
    job = base_job(assets, tmp_path)
    job["training"]["strategy"] = "fsdp"
    code, out, _ = cli("validate", str(write_job(tmp_path, job)), "--json")
    report = json.loads(out)
    assert code == 2 and report["valid"] is False
    assert report["problems"] == [
        {
            "field": "training.strategy",
            "value": "'fsdp'",
            "kind": "schema",
            "severity": "error",
            "message": "not allowed; use one of 'fsdp2', 'zero3' or 'ddp'",
        }
    ]


def test_json_of_a_valid_job_has_no_problems_and_its_notes(assets, tmp_path):
    code, out, _ = cli("validate", str(write_job(tmp_path, base_job(assets, tmp_path))), "--json")
    report = json.loads(out)
    assert code == 0 and report["valid"] is True and report["problems"] == []
    # the adapter audit (what LoRA adapts, per group) and the memory estimate
    assert [n["field"] for n in report["notes"]] == ["training.lora", "scaling.accelerator_memory_gb"]


def test_every_problem_is_reported_at_once(assets, tmp_path):
    """A broken section does not hide the others' problems, nor the probes of the sound ones."""
    job = base_job(assets, tmp_path)
    job["optimizer"] = {"lr": -1}
    job["training"]["global_batch_size"] = 1
    job["data"]["path"] = str(tmp_path / "missing.jsonl")
    job["tracking"]["uri"] = f"http://127.0.0.1:{free_port()}"
    code, out, _ = cli("validate", str(write_job(tmp_path, job)), "--json")
    fields = {p["field"] for p in json.loads(out)["problems"]}
    assert code == 2 and fields == {"optimizer.lr", "training.global_batch_size", "data.path", "tracking.uri"}


def test_llama_factory_demo_files_validate_without_a_mapping(assets, tmp_path):
    # alpaca_en_demo.json is a JSON array (it used to be refused as "row 1: not valid JSON").
    (tmp_path / "alpaca_en_demo.json").write_text(
        json.dumps(
            [
                {"instruction": "Describe a fox.", "input": "", "output": "A small wild canine."},
                {
                    "instruction": "Translate.",
                    "input": "bonjour",
                    "output": "hello",
                    "system": "be brief",
                    "history": [],
                },
            ],
            indent=2,
        )
    )
    (tmp_path / "sharegpt.jsonl").write_text(
        json.dumps(
            {
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
                "system": "be brief",
            }
        )
        + "\n"
    )
    job = base_job(assets, tmp_path)
    job["data"] = {
        "sources": [
            {"path": str(tmp_path / "alpaca_en_demo.json"), "format": "alpaca", "weight": 3},
            {"path": str(tmp_path / "sharegpt.jsonl"), "format": "sharegpt"},
        ],
        "seq_len": 32,
        "eval": {"fraction": 0.1, "every_n_steps": 5},
    }
    code, out, err = cli("validate", str(write_job(tmp_path, job)))
    assert code == 0 and "problem" not in err, err


def test_a_wide_elastic_range_is_valid_and_every_worker_count_gets_its_rows(assets, tmp_path):
    from raytrain.data import rank_slice

    job = base_job(assets, tmp_path)
    job["scaling"] = {"min_workers": 32, "max_workers": 64}
    job["training"].update(global_batch_size=512, micro_batch_size=4)
    code, out, err = cli("validate", str(write_job(tmp_path, job)), "--skip-probes")
    assert code == 0, err
    assert "workers 32..64, accumulation 2..4" in out  # ceil(512/64)=8 rows -> 2 micro-batches; ceil(512/32)=16 -> 4
    for world in range(32, 65):
        sizes = [b - a for a, b in (rank_slice(512, world, r) for r in range(world))]
        assert sum(sizes) == 512 and max(sizes) - min(sizes) <= 1


def test_validate_never_imports_torch_ray_or_deepspeed(assets, tmp_path):
    job = write_job(tmp_path, base_job(assets, tmp_path))
    script = (
        "import sys; from raytrain.cli import main; code = main(['validate', sys.argv[1]]); "
        "heavy = sorted(m for m in ('torch', 'ray', 'deepspeed', 'transformers', 'mlflow', 'peft') if m in "
        "sys.modules); "
        "print('heavy', heavy, 'code', code)"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(job)], capture_output=True, text=True, timeout=120)
    assert "heavy [] code 0" in proc.stdout, proc.stdout + proc.stderr


def test_run_refuses_an_invalid_job_before_ray(assets, tmp_path):
    job = base_job(assets, tmp_path)
    job["training"]["global_batch_size"] = 1
    script = (
        "import sys; from raytrain.cli import main; code = main(['run', sys.argv[1]]); "
        "print('ray imported' if 'ray' in sys.modules else 'no ray', code)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(write_job(tmp_path, job))], capture_output=True, text=True, timeout=120
    )
    assert "no ray 2" in proc.stdout and "training.global_batch_size = 1" in proc.stderr
    assert "nothing was started" in proc.stderr and "Traceback" not in proc.stderr


def test_an_allocator_choice_that_cannot_be_carried_out_is_refused_before_ray(assets, tmp_path):
    path = write_job(tmp_path, base_job(assets, tmp_path))
    code, _, err = cli("validate", str(path), env={"RAYTRAIN_HOST_ALLOCATOR": "jemalloc"})
    assert code == 2 and "RAYTRAIN_HOST_ALLOCATOR = 'jemalloc': " in err and "mimalloc (the default) or glibc" in err
    assert cli("validate", str(path), env={"RAYTRAIN_HOST_ALLOCATOR": "glibc"})[0] == 0


# ---------------------------------------------------------------- hub ids and what cannot be reached
def test_hub_id_is_a_note_checked_on_the_cluster(assets, tmp_path):
    job = base_job(assets, tmp_path)
    job["model"]["path"] = "meta-llama/Llama-3.1-8B"
    code, out, err = cli("validate", str(write_job(tmp_path, job)), env={"HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    assert code == 0, err
    assert "note: model.path = 'meta-llama/Llama-3.1-8B': a hub id" in err and "checked on the cluster" in err


@pytest.fixture
def hf_cache(tmp_path) -> dict:
    return hub_cache(tmp_path / "hf-cache", "meta-llama/Llama-3.1-8B")


def test_cached_hub_config_gets_the_memory_check(assets, tmp_path, hf_cache):
    job = base_job(assets, tmp_path)
    job["model"] = {"path": "meta-llama/Llama-3.1-8B", "tokenizer": str(assets / "model"), "dtype": "bfloat16"}
    job["data"]["seq_len"] = 4096
    job["training"].update(finetune="full", precision="bf16", global_batch_size=64, micro_batch_size=8)
    job["scaling"] = {"num_workers": 8, "use_gpu": True, "accelerator_memory_gb": 80}
    code, out, _ = cli("validate", str(write_job(tmp_path, job)), "--json", env=hf_cache)
    [problem] = json.loads(out)["problems"]
    assert code == 2 and problem["field"] == "scaling.accelerator_memory_gb" and problem["value"] == "80"
    # fp32 master weights, fp32 gradients and AdamW state: 16 B a parameter, as under ZeRO-3's bf16 mode.
    assert "weights 4 B × 8.03B params / 8" in problem["message"] and "config.json dimensions" in problem["message"]
    assert "optimizer (AdamW m, v) 8 B × 8.03B params / 8" in problem["message"]
    # A full fine-tune reduce-scatters every micro-batch (training.gradient_sync: auto), so no rank keeps
    # whole fp32 gradients while accumulating (+32 GB, which once made micro-batch 1 the only fit).
    assert "unsharded gradients" not in problem["message"]
    # 8 x 4096 tokens at a 128k vocabulary: training.chunked_loss (auto) keeps 523 tokens' logits, not 40 GiB.
    assert "logits (one chunk) 523·128256 × (2 + 4 + 4) B = 0.62 GiB" in problem["message"]
    # Packed rows under sdpa on GPUs in bf16 run torch's varlen kernel (kernels.py): no s×s mask (on CPU
    # workers, or in fp32, a boolean one a sequence: 8 x 4096² B).
    assert "attention mask" not in problem["message"]
    # The vocabulary layers' whole 16-bit gradients at the backward's end (RESULTS.md, "A tied table's gradient").
    assert "whole gradients of the output layer and embedding 2 × 128256·4096 × 2 B = 1.96 GiB" in problem["message"]
    # Only the root unit (the output layer) is held gathered at the loss; the untied embedding is a unit of its own.
    assert "largest gathered unit: the root (the output layer) 128256·4096 × 2 B = 0.98 GiB" in problem["message"]
    assert "smallest change that fits: training.micro_batch_size: 3 (≈ 71.33 GiB)" in problem["message"]


def test_keeping_whole_gradients_while_accumulating_is_counted(assets, tmp_path, hf_cache):
    job = base_job(assets, tmp_path)
    job["model"] = {"path": "meta-llama/Llama-3.1-8B", "tokenizer": str(assets / "model"), "dtype": "bfloat16"}
    job["data"]["seq_len"] = 4096
    job["training"].update(
        finetune="full", precision="bf16", global_batch_size=64, micro_batch_size=2, gradient_sync="last_micro_batch"
    )
    job["scaling"] = {"num_workers": 8, "use_gpu": True, "accelerator_memory_gb": 80}
    code, out, _ = cli("validate", str(write_job(tmp_path, job)), "--json", env=hf_cache)
    [problem] = json.loads(out)["problems"]
    assert "unsharded gradients while accumulating 4 B × 8.03B params = 29.92 GiB" in problem["message"]


@pytest.mark.parametrize("hsdp, divisor", [("auto", 8), (False, 16)])
def test_the_estimate_divides_by_the_shard_group_of_the_mesh(assets, tmp_path, hf_cache, hsdp, divisor):
    """16 GPUs on 2 nodes: HSDP (auto on GPU clusters) shards each copy over a node's 8 ranks."""
    job = base_job(assets, tmp_path)
    job["model"] = {"path": "meta-llama/Llama-3.1-8B", "tokenizer": str(assets / "model"), "dtype": "bfloat16"}
    job["data"]["seq_len"] = 4096
    job["training"].update(finetune="full", precision="bf16", global_batch_size=64, micro_batch_size=1)
    job["scaling"] = {
        "num_workers": 16,
        "workers_per_node": 8,
        "hsdp": hsdp,
        "use_gpu": True,
        "accelerator_memory_gb": 80,
    }
    code, out, _ = cli("validate", str(write_job(tmp_path, job)), "--json", env=hf_cache)
    report = json.loads(out)
    [memory] = [n for n in report["notes"] + report["problems"] if n["field"] == "scaling.accelerator_memory_gb"]
    assert f"weights 4 B × 8.03B params / {divisor} " in memory["message"], memory["message"]


def test_unreachable_hosts_are_notes_for_validate_and_errors_for_run(assets, tmp_path):
    from raytrain.validate import preflight

    job = base_job(assets, tmp_path)
    job["tracking"]["uri"] = "http://mlflow.invalid:5000"  # .invalid never resolves (RFC 2606)
    path = str(write_job(tmp_path, job))
    noted = preflight.check(path)
    assert noted.spec is not None and [p.field for p in noted.notes if p.kind == "tracking"] == ["tracking.uri"]
    refused = preflight.check(path, network_required=True)
    assert refused.spec is None and [p.field for p in refused.errors] == ["tracking.uri"]


def test_compile_auto_is_resolved_where_it_applies_and_zero3_lora_on_gpus_is_told_its_cost(assets, tmp_path):
    """training.compile: auto (the default) compiles on GPU workers where `true` is allowed and is
    never refused; a GPU job of LoRA under zero3 validates with a note of what it measured to cost."""
    from raytrain.job.plan import RunPlan
    from raytrain.job.spec import JobSpec
    from raytrain.validate import preflight

    def plan(training=None, scaling=None, data=None):
        job = base_job(assets, tmp_path)
        job["training"].update(training or {})
        job["scaling"].update(scaling or {})
        job["data"].update(data or {})
        return RunPlan.of(JobSpec.model_validate(job))

    gpu = {"use_gpu": True, "accelerator_memory_gb": 80}
    assert plan(scaling=gpu).compile and plan({"strategy": "ddp", "finetune": "full"}, gpu).compile
    assert not plan().compile  # CPU workers: eager
    for training, scaling in (
        ({"strategy": "zero3"}, {}),
        ({}, {"sequence_parallel": 2}),
        ({"finetune": "qlora"}, {}),
        ({"compile": False}, {}),
    ):
        assert not plan({"strategy": "fsdp2", **training}, {**gpu, **scaling}).compile, (training, scaling)
    job = base_job(assets, tmp_path)
    job["training"]["strategy"] = "zero3"
    job["scaling"].update(gpu)
    report = preflight.check(str(write_job(tmp_path, job)), probes=False)
    assert report.spec is not None
    [note] = [p for p in report.notes if p.kind == "speed"]
    assert note.field == "training.strategy" and "0.23x fsdp2's tokens/s" in note.message and "fsdp2" in note.message
    job["training"]["strategy"] = "fsdp2"
    assert not [p for p in preflight.check(str(write_job(tmp_path, job)), probes=False).notes if p.kind == "speed"]


@pytest.fixture(scope="module")
def s3(s3_server):
    """The S3 server with a bucket holding a dataset."""
    env, client = s3_server
    client.create_bucket(Bucket="runs")
    client.put_object(Bucket="runs", Key="data/prompts.jsonl", Body=b'{"prompt": "a fox"}\n')
    return env


def test_s3_storage_is_probed_with_a_write_and_delete(assets, tmp_path, s3):
    job = base_job(assets, tmp_path)
    job["checkpoint"]["storage_path"] = "s3://runs/raytrain"
    job["tracking"]["uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    code, _, err = cli("validate", str(write_job(tmp_path, job)), env=s3)
    assert code == 0, err
    job["checkpoint"]["storage_path"] = "s3://no-such-bucket/raytrain"
    code, _, err = cli("validate", str(write_job(tmp_path, job)), env=s3)
    assert code == 2 and "  - checkpoint.storage_path = 's3://no-such-bucket/raytrain': not writable" in err


def test_s3_dataset_first_rows_are_read(assets, tmp_path, s3):
    job = base_job(assets, tmp_path)
    job["data"]["path"] = "s3://runs/data/"
    code, _, err = cli("validate", str(write_job(tmp_path, job)), env=s3)
    assert code == 2 and "  - data.columns.text = 'text': no such column" in err and "columns there: prompt" in err


@pytest.mark.slow
def test_a_live_mlflow_server_passes(assets, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/db.sqlite",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        import time
        import urllib.request

        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        job = base_job(assets, tmp_path)
        job["tracking"]["uri"] = f"http://127.0.0.1:{port}"
        code, _, err = cli("validate", str(write_job(tmp_path, job)))
        assert code == 0, err
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


# ---------------------------------------------------------------- the memory estimate's parts, against torch and peft
def test_parameter_count_and_names_match_torch(assets):
    from transformers import AutoModelForCausalLM

    from raytrain.model.facts import layout_from_config, read_facts

    facts = read_facts(assets / "model")
    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    torch_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert facts.shapes == torch_shapes and facts.n_params == sum(p.numel() for p in model.parameters())
    assert layout_from_config(facts.config) == torch_shapes  # the config-only path lays out the same model


def test_lora_parameter_count_matches_peft(assets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raytrain.model.facts import read_facts

    targets = ["q_proj", "v_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(assets / "model")),
        LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert read_facts(assets / "model").lora_params(targets, 4) == trainable


def test_llama_8b_from_config_is_8_03b_parameters():
    from raytrain.model.facts import ModelFacts, layout_from_config

    facts = ModelFacts(LLAMA_31_8B, layout_from_config(LLAMA_31_8B), "config", False)
    assert facts.n_params == 8_030_261_248  # the published count
    assert facts.layer_params == 218_112_000


def test_the_suggested_change_fits_and_the_job_did_not(assets, tmp_path):
    from conftest import make_job

    from raytrain.model.facts import ModelFacts, layout_from_config
    from raytrain.validate.memory import GiB, estimate, smallest_fix

    facts = ModelFacts(LLAMA_31_8B, layout_from_config(LLAMA_31_8B), "config", False)
    for budget_gb, over in (
        (80, {"finetune": "full", "micro_batch_size": 8}),
        (24, {"finetune": "full"}),
        (40, {"strategy": "ddp", "finetune": "lora", "micro_batch_size": 2}),
    ):
        spec = make_job(
            assets,
            tmp_path,
            data={"seq_len": 4096},
            model={"dtype": "bfloat16"},
            training={"global_batch_size": 64, "micro_batch_size": 2, **over},
            scaling={"num_workers": 8, "use_gpu": True},
        )
        assert estimate(spec, facts, 8).total > budget_gb * GiB
        text, fitted = smallest_fix(spec, facts, budget_gb * GiB)
        assert fitted.total <= budget_gb * GiB, text
