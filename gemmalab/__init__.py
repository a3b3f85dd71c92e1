"""gemmalab: fine-tune Gemma 3 with JAX, from a laptop CPU to a multislice TPU pod.

Stages, each importing only those below it and the ground:

- ground: ``config`` (the validated run config), ``accelerators`` (the chip catalogue),
  ``data_parallel`` (the batch's split), ``errors``, ``storage``, ``gemma_lib``, ``headless``
  (papermill for ``make demo``);
- ``model``: presets, attention, LoRA, loss, mesh and sharding;
- ``weights``: every weight source and sink (Orbax, HF, PEFT, GGUF, the embedded base);
- ``data``: corpus, records, tokenizer, token cache, packing, batches;
- ``plan``: per-device memory, FLOPs and a roofline time before a run;
- ``train``: the ``Experiment`` loop and its collaborators;
- ``inspect``: sampling, comparison, task metric, reports, traces;
- ``k8s``: GKE manifests and submission (imports only the ground).
"""
