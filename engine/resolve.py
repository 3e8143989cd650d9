"""Where a CKPT argument lives: a local path, or a Hugging Face model id.

A CKPT that is not an existing local path is looked up as a model id through
`huggingface_hub` the way `from_pretrained` does: the local cache first (a snapshot of the
revision), a download of the checkpoint's files when online, nothing but the cache when
`HF_HUB_OFFLINE=1`. Only the files memengine reads are fetched (config, safetensors weights or
shards with their index, tokenizer and generation configs).

`public_name` gives what may be written into an output's metadata or run record: a model id,
a relative path as the user gave it, or only the base name of an absolute path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import MemengineError

# the files of a model repo that memengine reads (fnmatch patterns on the repo path)
HUB_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "model.safetensors", "model.safetensors.index.json",
    "model-*-of-*.safetensors", "optimizer.safetensors",
]


@dataclass(frozen=True)
class CheckpointRef:
    spec: str                    # as the user gave it
    path: Path                   # the local directory or file
    repo_id: str | None = None   # when it came through the Hugging Face cache
    revision: str | None = None
    model_type: str | None = None  # "mamba" | "falcon_mamba" when the user said which

    def __str__(self) -> str:
        return self.spec

    @property
    def public_name(self) -> str:
        """The id (with @revision), or the path as given when relative, else its base name."""
        if self.repo_id is not None:
            return self.repo_id + (f"@{self.revision}" if self.revision else "")
        return public_path(self.spec)


def public_path(path: str | Path) -> str:
    """A path as it may go into an output file: as given when relative, else its base name."""
    s = str(path)
    p = Path(s)
    return p.name if p.is_absolute() else s


def resolve_checkpoint(spec: str | Path | CheckpointRef, revision: str | None = None,
                       model_type: str | None = None, *, cache_dir: str | Path | None = None) -> CheckpointRef:
    """A local path as it is, else a model id through the Hugging Face cache (see module doc).
    Any failure is one MemengineError line."""
    if isinstance(spec, CheckpointRef):
        return spec
    s = str(spec)
    p = Path(s)
    if p.exists():
        if revision is not None:
            raise MemengineError(f"--revision {revision}: '{s}' is a local path; a revision applies to model ids")
        return CheckpointRef(s, p, model_type=model_type)
    local = _snapshot(s, revision, cache_dir)
    if not any((local / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise MemengineError(f"model id '{s}'{_at(revision)} has no model.safetensors or model.safetensors.index.json "
                             "(memengine reads safetensors weights only)")
    return CheckpointRef(s, local, repo_id=s, revision=revision, model_type=model_type)


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _snapshot(repo_id: str, revision: str | None, cache_dir) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub import errors as herr
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # pragma: no cover - a runtime dependency
        raise MemengineError(f"checkpoint '{repo_id}' not found (and huggingface_hub is not installed "
                             "to look it up as a model id)") from None
    where = "neither a local path nor a model id"
    try:
        validate_repo_id(repo_id)
    except herr.HFValidationError:
        raise MemengineError(f"checkpoint '{repo_id}' not found ({where})") from None
    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                          allow_patterns=HUB_FILES))
    except herr.RevisionNotFoundError:
        raise MemengineError(f"--revision {revision}: not found in model id '{repo_id}'") from None
    except herr.RepositoryNotFoundError:  # also gated/private without a token
        raise MemengineError(f"checkpoint '{repo_id}' not found: no such local path, and the Hugging Face Hub "
                             "has no model of that id that this login can read") from None
    except herr.LocalEntryNotFoundError:
        if offline:
            raise MemengineError(f"checkpoint '{repo_id}' not found: no such local path, and no model id of that "
                                 f"name{_at(revision)} in the local Hugging Face cache (HF_HUB_OFFLINE=1: "
                                 "no download)") from None
        raise MemengineError(f"checkpoint '{repo_id}' not found: no such local path, not in the local Hugging Face "
                             f"cache{_at(revision)}, and the Hub cannot be reached") from None
    except (herr.HfHubHTTPError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise MemengineError(f"model id '{repo_id}'{_at(revision)}: cannot fetch it ({first})") from None
