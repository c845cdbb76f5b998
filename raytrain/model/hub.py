"""A model's files as the hub and the node's Hugging Face cache hold them, without torch: the commit
a revision names, the local folder of the pinned files, their weight files and hashes, and the
tokenizer. The driver, `raytrain validate` and the prepare step use these; so do the workers.

The tokenizer is loaded as its own class (`tokenizer_config.json`'s `tokenizer_class`: transformers'
tokenizer classes import no torch), which is what AutoTokenizer resolves first too. AutoTokenizer
itself imports transformers' configuration machinery, and with it torch (2-6 s on a small CPU): a
driver that prepares a small dataset would map libtorch for nothing. A tokenizer that names no class
(or one transformers lacks) falls back to AutoTokenizer."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from raytrain.errors import JobError
from raytrain.job.spec import JobSpec

COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub commit id, as git names it
TOKENIZER_CONFIG = "tokenizer_config.json"


def resolve_commit(spec: JobSpec) -> str | None:
    """The hub commit `model.revision` names now (None for a local folder). The driver calls it
    once and pins the job to it, so a push to the hub mid-run cannot change the frozen base."""
    if Path(spec.model.path).is_dir():
        return None
    from huggingface_hub import hf_hub_download

    try:
        config = hf_hub_download(spec.model.path, "config.json", revision=spec.model.revision)
    except Exception as exc:  # offline and not cached, no such repo or revision, no access
        raise JobError(
            f"model.path {spec.model.path!r} at model.revision {spec.model.revision or 'main'!r}: cannot "
            f"resolve it to a commit ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Check the hub id and revision, HF_TOKEN for a gated model, or download it into the "
            "Hugging Face cache of every node (hf download)"
        ) from None
    return Path(config).parent.name  # the cache keeps each file under snapshots/<commit>/


def load_tokenizer(spec: JobSpec):
    """The job's tokenizer (`model.tokenizer`, else `model.path`'s, at the pinned revision), with a pad
    token (its eos where it has none)."""
    import transformers

    name = spec.model.tokenizer or spec.model.path
    kwargs = spec.model.hub_kwargs(name)
    cls = _tokenizer_class(name, kwargs) or transformers.AutoTokenizer
    tok = cls.from_pretrained(name, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_class(name: str, kwargs: dict):
    """The class `tokenizer_config.json` names, as transformers exports it (its "...Fast" aliases
    included), or None: then AutoTokenizer decides. Remote code is AutoTokenizer's business."""
    if kwargs.get("trust_remote_code"):
        return None
    folder = Path(name)
    if folder.is_dir():
        file = folder / TOKENIZER_CONFIG
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(name, TOKENIZER_CONFIG, revision=kwargs.get("revision")))
        except Exception:  # not on the hub or not cached: AutoTokenizer says why
            return None
    try:
        named = json.loads(file.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    import transformers

    for candidate in (named, named[: -len("Fast")] if named and named.endswith("Fast") else None):
        cls = getattr(transformers, candidate, None) if candidate else None
        if cls is not None:
            return cls
    return None


def model_folder(spec: JobSpec, download: bool = False) -> Path | None:
    """The local folder of `model.path`'s files: the folder itself, or the hub snapshot of the
    pinned revision in this node's Hugging Face cache (fetched first if `download`: its
    json and safetensors files only). None if there is none."""
    folder = Path(spec.model.path)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                spec.model.path,
                revision=spec.model.revision,
                local_files_only=not download,
                allow_patterns=["*.json", "*.safetensors"],
            )
        )
    except Exception:  # offline and not cached, gated: the caller falls back to from_pretrained
        return None


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))


def base_files(spec: JobSpec) -> dict[str, str]:
    """sha256 of each weight file of the base model, by file name: what identifies the base an
    adapter was trained on (compare with `sha256sum`, or the hub's file list). A hub file in the
    cache is stored under its sha256 already (the LFS id), so only local folders are read."""
    folder = model_folder(spec)
    digests = {}
    for file in weight_files(folder) if folder else []:
        blob = file.resolve().name
        if not re.fullmatch(r"[0-9a-f]{64}", blob):
            digest = hashlib.sha256()
            with open(file, "rb") as f:
                while chunk := f.read(16 << 20):
                    digest.update(chunk)
            blob = digest.hexdigest()
        digests[file.name] = blob
    return digests
