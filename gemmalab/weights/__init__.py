"""The weights stage: every weight source and sink.

- ``sources``: the ``checkpoint`` parameter resolved and read, for every format (CheckpointPath
  names, Orbax and Hugging Face directories, GGUF files, the embedded base);
- ``orbax_params``: params as Orbax checkpoints (gemma's own format);
- ``hf_layout``: gemma's params <-> Hugging Face Gemma 3 and Gemma 4 safetensors, both ways
  (``hf_gemma4``: Gemma 4's layout);
- ``peft_adapters``: LoRA adapters in PEFT's layout;
- ``export``: a finished run exported (``python -m gemmalab.weights``);
- ``gguf``: llama.cpp GGUF files checked, dequantized into their shards and cached;
- ``gguf_vocab``: a GGUF's vocabulary rebuilt as the SentencePiece model it came from, and back;
- ``gguf_export``: a finished run as one llama.cpp GGUF file (gemma3);
- ``embedded``: the pretrained bases that PyPI packages ship (offline, no hub);
- ``safetensors_io``: the safetensors file format, read and written by us.

May import: the ground and ``gemmalab.model`` (presets, LoRA's tree).
"""
