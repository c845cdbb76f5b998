"""Export in one process, no Ray: the plain Hugging Face folder a full fine-tune writes,
for a model that ships its own code (trust_remote_code) too."""

from __future__ import annotations

import json
import shutil

import torch

from conftest import make_job

MODELING = '''
from transformers import LlamaConfig, LlamaForCausalLM


class TinyConfig(LlamaConfig):
    model_type = "tiny-custom"


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
'''


def test_full_export_of_a_model_with_its_own_code(assets, tmp_path):
    # It used to rebuild the plain copy without trust_remote_code and fail after training.
    from transformers import AutoModelForCausalLM

    from raytrain import modeling
    from raytrain.strategies.base import write_hf_export

    folder = tmp_path / "custom"
    shutil.copytree(assets / "model", folder)
    (folder / "modeling_tiny.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny-custom", architectures=["TinyForCausalLM"],
                  auto_map={"AutoConfig": "modeling_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    spec = make_job(assets, tmp_path, model={"path": str(folder), "trust_remote_code": True},
                    training={"finetune": "full"})
    model = modeling.load_model(spec)
    assert type(model).__name__ == "TinyForCausalLM"
    write_hf_export(spec, model, model.state_dict(), str(tmp_path / "out"), modeling.load_tokenizer(spec))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    assert type(exported).__name__ == "TinyForCausalLM"
    probe = torch.tensor([[5, 17, 42, 9, 33]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=probe).logits, model.eval()(input_ids=probe).logits, rtol=0, atol=0)
