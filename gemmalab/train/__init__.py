"""The train stage: the state, optimizer and compiled steps, the ``Experiment`` loop and its
collaborators (parameters, checkpoints, metrics, preemption, compile cache, multi-process join),
and the step compiled ahead of time for the exact memory plan.

May import: the ground, ``gemmalab.model``, ``gemmalab.weights``, ``gemmalab.data`` and
``gemmalab.plan``.
"""
