"""memengine.engine: everything a run does (see DEVELOPERS.md, Layout): the GPU backend and
runtime, the kernels, the architectures (engine/models: a registry by model_type, the
shared LM shell, Mamba-1 / Falcon-Mamba), training, files and formats, LoRA, the commands'
runs.

Nothing here imports rich or typer; progress leaves through callbacks.
"""

try:
    from importlib.metadata import version as _version

    __version__ = _version("memengine")
except Exception:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"
