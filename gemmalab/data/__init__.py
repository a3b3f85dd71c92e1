"""The data stage: the embedded corpus generator, documents and chat records, the tokenizer, the
token cache, windows and packing, the checkpointable grain iterator, and layout tables.

May import: the ground, ``gemmalab.model`` (presets) and ``gemmalab.weights`` (a checkpoint's
own tokenizer: the GGUF vocabulary, the embedded base).
"""
