"""memengine.engine: the GPU runtime, the Mamba-1 model and its training loop.

Nothing here imports rich or typer; progress leaves through callbacks.
"""

try:
    from importlib.metadata import version as _version

    __version__ = _version("memengine")
except Exception:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"
