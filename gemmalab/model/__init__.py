"""The model stage: Gemma 3 presets, attention kernels, LoRA, the loss, the mesh and the sharding
rules that place each weight on it.

May import: the ground (``gemmalab.config``, ``errors``, ``storage``, ``gemma_lib``).
"""
