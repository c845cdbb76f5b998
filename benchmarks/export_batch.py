"""M5 by batch size: `raytrain export` of a full fine-tune's checkpoint (the SmolLM2 shape, fp32, one
DCP file, as `benchmarks.memory.full_checkpoint` writes it), in a process of its own per batch size
(`raytrain.export.BATCH_BYTES`), its resident peak above its floor (the process with the model's code
loaded, `benchmarks.memory.export_cli_peak`) over the model's bytes, and its time.

    .venv/bin/python -m benchmarks.export_batch 256 64 32 0   # MiB a DCP load; 0: one tensor a load
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import harness as h
from . import memory as m


def main(argv: list[str]) -> None:
    from raytrain.job.spec import JobSpec
    from raytrain.rundir import signing

    s = h.SETTINGS["quick"]
    model, (_, data) = m.smollm2_shape(s), h.assets(s)
    signing.ensure_key()
    folder = h.scratch("export-batch")
    try:
        spec = JobSpec.model_validate(
            h.job(s, "m5-batch", folder / "runs", model, data, training={"strategy": "fsdp2", "finetune": "full"})
        )
        run_dir = m.full_checkpoint(spec, model, folder)
        model_bytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        for mib in map(int, argv or ["256", "64", "0"]):
            r = m.export_cli_peak(run_dir, str(folder / f"export-{mib}"), mib << 20)
            rise = r["peak"] - r["base"]
            print(
                f"M5 batch {mib} MiB: peak above its floor {rise / 2**30:.3f} GiB / model "
                f"{model_bytes / 2**30:.2f} GiB = {rise / model_bytes:.2f} (above the bare process before the "
                f"model's code: {(r['peak'] - r['bare']) / model_bytes:.2f}), {r['s']:.1f} s",
                flush=True,
            )
    finally:
        h.cleanup(folder)


if __name__ == "__main__":
    main(sys.argv[1:])
