"""Where a CKPT argument lives: a local path, or a Hugging Face model id.

A CKPT that is not an existing local path is looked up as a model id through
`huggingface_hub` the way `from_pretrained` does: the local cache first (a snapshot of the
revision), a download of the checkpoint's files when online, nothing but the cache when
`HF_HUB_OFFLINE=1`. Only the files memengine reads are fetched (config, safetensors weights or
shards with their index, tokenizer and generation configs).

`memengine info` asks for less (`weights=False`): for a model id whose weights are not in the
cache (and when online) it fetches the small files only and reads the weights' safetensors
headers from the Hub (`remote_headers`: ranges of the files), so a model can be looked at,
and its memory plan checked, before gigabytes are downloaded.

`public_name` gives what may be written into an output's metadata or run record: a model id,
a relative path as the user gave it, or only the base name of an absolute path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from memengine.engine.errors import MemengineError

# the files of a model repo that memengine reads (fnmatch patterns on the repo path)
HUB_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "model.safetensors", "model.safetensors.index.json",
    "model-*-of-*.safetensors", "optimizer.safetensors",
]
# all of them but the weights (and the optimizer state): what `info` fetches when they are not cached
HEADER_FILES = [f for f in HUB_FILES if not f.endswith(".safetensors")]


@dataclass(frozen=True)
class CheckpointRef:
    spec: str                    # as the user gave it
    path: Path                   # the local directory or file
    repo_id: str | None = None   # when it came through the Hugging Face cache
    revision: str | None = None
    model_type: str | None = None  # "mamba" | "falcon_mamba" when the user said which
    # the weights' headers read from the Hub when only those were asked for (`weights=False`)
    headers: tuple | None = field(default=None, compare=False, repr=False)

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
                       model_type: str | None = None, *, cache_dir: str | Path | None = None,
                       weights: bool = True) -> CheckpointRef:
    """A local path as it is, else a model id through the Hugging Face cache (see module doc).
    `weights=False`: a model id whose weights are not cached comes with their headers read
    from the Hub instead (`CheckpointRef.headers`; online only). Any failure is one
    MemengineError line."""
    if isinstance(spec, CheckpointRef):
        return spec
    s = str(spec)
    p = Path(s)
    if p.exists():
        if revision is not None:
            raise MemengineError(f"--revision {revision}: '{s}' is a local path; a revision applies to model ids")
        return CheckpointRef(s, p, model_type=model_type)
    if not weights and not _weights_cached(s, revision, cache_dir):
        local = _snapshot(s, revision, cache_dir, HEADER_FILES)
        return CheckpointRef(s, local, repo_id=s, revision=revision, model_type=model_type,
                             headers=tuple(remote_headers(s, revision, local)))
    local = _snapshot(s, revision, cache_dir)
    if not _has_weights(local):
        raise _no_safetensors(s, revision)
    return CheckpointRef(s, local, repo_id=s, revision=revision, model_type=model_type)


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _no_safetensors(repo_id: str, revision: str | None) -> MemengineError:
    return MemengineError(f"model id '{repo_id}'{_at(revision)} has no model.safetensors or "
                          "model.safetensors.index.json (memengine reads safetensors weights only)")


def _has_weights(local: Path) -> bool:
    return any((local / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))


def _weights_cached(repo_id: str, revision: str | None, cache_dir) -> bool:
    """Whether the cache holds this revision with its weights (True offline: there the cache
    is all there is, and resolving as usual says what is missing)."""
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        return True
    try:
        local = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                       allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:   # not cached, or not a model id at all (resolving as usual says which)
        return False
    if not (local / "model.safetensors.index.json").is_file():
        return (local / "model.safetensors").is_file()
    from memengine.engine.io.shards import read_index  # every shard the index names

    try:
        return all((local / f).is_file() for f in set(read_index(local / "model.safetensors.index.json").values()))
    except MemengineError:
        return True   # resolving as usual reports the broken index


def remote_headers(repo_id: str, revision: str | None, local: Path) -> list:
    """The safetensors headers of a model id's weights, read from the Hub by ranges of the
    files (huggingface_hub.get_safetensors_metadata), as SafetensorsHeader under `local`
    (the files are not there). Their data offsets are the Hub's; a header's own size is not
    known, so `file_size` is the size of its tensor data."""
    from huggingface_hub import errors as herr
    from huggingface_hub import get_safetensors_metadata
    from memengine.engine.io.safetensors_io import SafetensorsHeader, TensorInfo

    try:
        meta = get_safetensors_metadata(repo_id, revision=revision)
    except herr.NotASafetensorsRepoError:
        raise _no_safetensors(repo_id, revision) from None
    except herr.SafetensorsParsingError as e:
        raise MemengineError(f"model id '{repo_id}'{_at(revision)}: its weights' headers do not parse "
                             f"({str(e).strip().splitlines()[0][:200]})") from None
    except (herr.HfHubHTTPError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise MemengineError(f"model id '{repo_id}'{_at(revision)}: cannot read its weights' headers ({first})") from None
    headers = []
    for fname in sorted(meta.files_metadata):
        fm = meta.files_metadata[fname]
        tensors = {name: TensorInfo(name, str(t.dtype), tuple(int(d) for d in t.shape),
                                    int(t.data_offsets[0]), int(t.data_offsets[1]))
                   for name, t in fm.tensors.items()}
        headers.append(SafetensorsHeader(path=local / fname, tensors=tensors, metadata=dict(fm.metadata or {}),
                                         data_start=0, file_size=max((t.end for t in tensors.values()), default=0)))
    if not headers:
        raise MemengineError(f"model id '{repo_id}'{_at(revision)}: the Hub lists no weight files")
    return headers


def _snapshot(repo_id: str, revision: str | None, cache_dir, patterns: list = HUB_FILES) -> Path:
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
                                          allow_patterns=patterns))
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
