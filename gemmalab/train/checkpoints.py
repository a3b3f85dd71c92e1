"""The run's own checkpoints: the whole train state and each process's data-iterator position,
to resume from; the run's config beside them, checked on a resume.
"""

from __future__ import annotations

from typing import Any

from gemmalab import storage
from gemmalab.errors import ConfigError
from gemmalab.weights.orbax_params import absolute_path

CHECKPOINTS_DIR = "checkpoints"


CONFIG_FILE = "train_config.json"


# Fields a resumed run must share with the run that wrote the checkpoints: they decide the
# state's shapes or which rows come next. (The mesh may change: Orbax restores into any
# sharding. The schedule may change, e.g. more max_steps to train on.)
RESUME_FIELDS = ("model", "num_layers", "maxlen", "batch_size", "packing", "seed", "data_path",
                 "datacount",
                 "embedded_stories", "eval_fraction", "max_eval_stories", "tokenizer",
                 "tokenizer_vocab_size", "param_dtype", "checkpoint", "lora_rank", "lora_alpha",
                 "lora_modules", "lora_train_tokens", "train_on_prompt", "skip_bad_records",
                 "objective")


class TrainCheckpoints:
    """``output_dir/checkpoints/<step>``: the train state and each process's data-iterator
    position, saved asynchronously by Orbax (all processes together; each writes and later
    reads only its own shards), the last ``keep`` kept.

    Orbax writes a step into a temporary directory and renames it when complete, so a crash
    mid-save leaves no half checkpoint under a step's name; ``restore_latest`` also falls back
    past a finished checkpoint that no longer reads (e.g. a truncated file), with a warning.
    """

    def __init__(self, output_dir: str, *, keep: int, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.output_dir = output_dir
        self.directory = f"{absolute_path(output_dir)}/{CHECKPOINTS_DIR}"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                              options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, iterator: Any) -> None:
        """Start saving ``step`` (returns once the state is copied off the devices)."""
        import grain.checkpoint
        import orbax.checkpoint as ocp

        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator)))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, iterator: Any) -> tuple[int, Any] | None:
        """``(step, state)`` of the newest readable checkpoint, the iterator moved to its
        position; None if there is none. Checkpoints of which none loads are refused: starting
        over would overwrite the run they hold."""
        import warnings

        import grain.checkpoint
        import orbax.checkpoint as ocp

        steps = self.steps()
        first_error = ""
        for step in reversed(steps):
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=grain.checkpoint.CheckpointRestore(iterator)))
            except Exception as error:  # unreadable: fall back to the one before
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                first_error = first_error or reason
                warnings.warn(f"checkpoint {self.directory}/{step} does not load ({reason}); "
                              "trying an older one", stacklevel=2)
                continue
            return step, restored.state
        if steps:
            raise ConfigError("output_dir", f"none of the {len(steps)} checkpoints in "
                              f"{self.directory} loads into this run's state (step "
                              f"{steps[-1]}: {first_error})",
                              "resume with the settings of the run that wrote them, or use a "
                              "new output_dir (delete its checkpoints/ to start over there)")
        return None

    def close(self) -> None:
        self._manager.close()


def stored_config(output_dir: str) -> dict[str, Any] | None:
    """The config of the earlier run whose checkpoints are in ``output_dir``; None when it saved
    none (e.g. it was stopped before its first save, or only profiled)."""
    import json

    from etils import epath

    directory = epath.Path(absolute_path(output_dir)) / CHECKPOINTS_DIR
    path = directory / CONFIG_FILE
    if not path.exists() or not any(p.name.isdigit() for p in directory.iterdir()):
        return None
    return json.loads(path.read_text())


def write_config(output_dir: str, values: dict[str, Any]) -> None:
    import json

    from etils import epath

    directory = epath.Path(absolute_path(output_dir)) / CHECKPOINTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(values, indent=1))


def check_resumable(values: dict[str, Any], stored: dict[str, Any], output_dir: str) -> None:
    """One-line error naming the first field that differs from the checkpointed run's."""

    for name in (*RESUME_FIELDS, "processes"):
        if name in stored and stored[name] != values.get(name):
            raise ConfigError(name, f"{values.get(name)!r} differs from {stored[name]!r} of the "
                              f"run checkpointed in {output_dir}",
                              f"use {name}={stored[name]!r} to resume it, or a new output_dir "
                              "to start another run")


def is_empty_dir(path: str) -> bool:
    from etils import epath

    directory = epath.Path(absolute_path(path))
    return not directory.exists() or not any(directory.iterdir())


def require_writable_room(output_dir: str, needed_bytes: int) -> None:
    """``output_dir`` can be written and (on local disks) has room for ``needed_bytes``.

    Checked before any expensive work, so a run never trains for hours and then fails to save.
    """
    import shutil

    if storage.is_gcs(output_dir):
        return  # credentials are checked separately; buckets have no free-space figure
    directory = storage.require_writable_directory("output_dir", absolute_path(output_dir))
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise ConfigError("output_dir", f"{output_dir} has {free / 2**30:.2f} GiB free but a "
                          f"checkpoint and the final params need ~{needed_bytes / 2**30:.2f} GiB",
                          "free disk space or choose output_dir on a larger disk (or gs://)")


def require_steps_ahead(saved: TrainCheckpoints, total_steps: int, *, resume: bool,
                        by_max_steps: bool) -> None:
    """A resumed run must not be told to stop before where it already is: it would train no
    step and save the further state under a smaller step's name. ``by_max_steps``: the run's
    length is ``max_steps`` (else ``num_epochs``), the parameter the error names."""
    done = max(saved.steps(), default=0) if resume else 0
    if done > total_steps:
        raise ConfigError(
            "max_steps" if by_max_steps else "num_epochs",
            f"the run in {saved.output_dir} has done {done} steps, more than "
            f"the {total_steps} this config trains",
            f"use max_steps >= {done} to continue it, or a new output_dir",
        )


def resume_values(params: dict[str, Any]) -> dict[str, Any]:
    """The run's record beside its checkpoints, what a resumed run must match
    (``check_resumable``): its flat parameters (``TrainConfig.to_dict``) and the process
    count."""
    import jax

    return {**params, "processes": jax.process_count()}


def previous_run(output_dir: str, *, resume: bool, values: dict[str, Any]
                 ) -> dict[str, Any] | None:
    """The record of the checkpointed run in ``output_dir`` that this one continues, checked
    to match this run's ``values`` (``resume_values``); None for a new run."""
    stored = stored_config(output_dir)
    if stored is not None and not resume:
        raise ConfigError(
            "resume",
            f"{output_dir} holds the checkpoints of an earlier run",
            "use resume=True to continue it, or a new output_dir",
        )
    if stored is None and not resume and not is_empty_dir(output_dir):
        raise ConfigError("resume", f"resume=False but {output_dir} is not empty",
                          "use a new or empty output_dir")
    if stored is not None:
        check_resumable(values, stored, output_dir)
    return stored
