"""The one door to the ``gemma`` library, imported lazily: it pulls TensorFlow (~15 s)."""

from __future__ import annotations

import os
from types import ModuleType


def gm() -> ModuleType:
    """``gemma.gm``, with TensorFlow's start-up banners off (gemmalab runs no TF ops)."""
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from gemma import gm as module

    return module
