"""The Mamba-2 layer on the GPU: engine/models/ssd_mixer.py (shared with the hybrids, which
take the same mixer under their own tensor names)."""

from memengine.engine.models.ssd_mixer import LAYER_FIELDS, Mamba2Block  # noqa: F401
