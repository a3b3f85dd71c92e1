"""The inspect stage: sampling, base-vs-fine-tuned comparison, the task metric, report tables and
plots, XProf trace analysis and profiling, and the run summary printer.

May import: every stage below it (``train``, ``plan``, ``data``, ``weights``, ``model``) and the
ground.
"""
