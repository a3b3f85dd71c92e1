"""One process of a real multi-process JAX run on localhost (started by test_multiprocess.py,
with two CPU devices a process in XLA_FLAGS).

usage (in the repository's root, for ``tests.helpers``):
    python -m tests.train.multiprocess_worker PROCESS_ID NUM_PROCESSES PORT DATA_PATH WORK_DIR \\
        [fsdp|data]

With ``fsdp``: 20 steps of the tiny model with fsdp spanning both processes, fed slices of fixed
global batches (as test_sharding's one-process runs are), then a sharded Orbax save and restore.
With ``data``: the data preparation alone (DATA_PATH Parquet): which rows each process read to
build its token cache, its documents, the step counts, and its batch iterator resumed.
"""

import json
import sys


def main() -> None:
    process_id, num_processes, port = (int(x) for x in sys.argv[1:4])
    data_path, work_dir = sys.argv[4:6]
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)

    if sys.argv[6:] == ["fsdp"]:
        return fsdp_across_processes(work_dir)
    if sys.argv[6:] == ["data"]:
        return data_across_processes(data_path, work_dir)

    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    # fsdp over both processes: each holds and checkpoints only its shards.
    config = TrainConfig.flat(
        model="gemma3-tiny", data_path=data_path,
        cache_dir=f"{work_dir}/cache{process_id}",  # one cache per "host"
        output_dir=f"{work_dir}/run", batch_size=8, maxlen=64, max_steps=6, eval_every=3,
        tokenizer_vocab_size=600, tokenize_workers=1, seed=5, mesh={"fsdp": -1},
        checkpoint_every=3, num_layers=2)
    experiment = Experiment.prepare(config)
    summary = experiment.train(progress=False)
    resumed_losses, resumed_from = crash_and_resume(config, f"{work_dir}/crashed")
    sample = experiment.sample("Once upon a time", max_new_tokens=6)  # every host, as notebooks do
    saved = experiment.save()
    linear = experiment.weights.state.params["layer_0"]["mlp"]["linear"]
    result = {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "train_docs": experiment.data_stats["train_docs"],
        "eval_docs": experiment.data_stats["eval_docs"],
        "tokenizer": experiment.prepared.tokenizer_info.fingerprint,
        "losses": [r["loss"] for r in experiment.history],
        "final_eval_loss": summary["final_eval_loss"],
        "initial_eval_loss": summary["initial_eval_loss"],
        "saved": saved,
        "sample": sample.record(),
        "resumed_losses": resumed_losses,
        "resumed_from": resumed_from,
        "params_sharded": linear.addressable_shards[0].data.shape != linear.shape,
    }
    with open(f"{work_dir}/result{process_id}.json", "w") as f:
        json.dump(result, f)


def crash_and_resume(config, output_dir: str) -> tuple[list[float], int]:
    """The same run killed before step 5 on every process, then started again."""

    from gemmalab.train.experiment import Experiment

    config = config.replace(output_dir=output_dir)
    first = Experiment.prepare(config)
    real, calls = first.compile(), [0]

    def step_or_crash(state, batch, frozen=None):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("killed")
        return real(state, batch, frozen)

    first.train_step = step_or_crash
    try:
        first.train(progress=False)
    except RuntimeError:
        first.checkpoints.wait()
    second = Experiment.prepare(config)
    second.train(progress=False)
    return [r["loss"] for r in second.history], second.weights.start_step


def data_across_processes(data_path: str, work_dir: str) -> None:
    import jax
    import numpy as np

    from gemmalab.config import TrainConfig
    from gemmalab.data import parquet, preparation, token_cache
    from gemmalab.weights import resolution

    rows_read, building = [], [False]
    real_rows, real_build = parquet.iter_rows, token_cache._build_token_cache

    def logged_rows(*args, **kwargs):
        for item in real_rows(*args, **kwargs):
            if building[0]:
                rows_read.append(item[0])
            yield item

    def logged_build(*args, **kwargs):
        building[0] = True
        try:
            return real_build(*args, **kwargs)
        finally:
            building[0] = False

    parquet.iter_rows, token_cache._build_token_cache = logged_rows, logged_build
    config = resolution.resolve(TrainConfig.flat(
        model="gemma3-tiny", data_path=data_path,
        cache_dir=f"{work_dir}/cache{jax.process_index()}", batch_size=8,
        maxlen=64, tokenizer_vocab_size=600, tokenize_workers=1, seed=5, eval_fraction=0.1,
        max_eval_stories=3)).config
    prepared = preparation.prepare_data(config)
    data = preparation.training_data(prepared, config.data, config.trainer)
    for _ in range(2):
        next(data.train_iterator)
    state = data.train_iterator.get_state()
    after = [next(data.train_iterator) for _ in range(2)]
    resumed = preparation.training_data(prepared, config.data, config.trainer).train_iterator
    resumed.set_state(state)
    again = [next(resumed) for _ in range(2)]
    result = {
        "train_docs": prepared.cache.train.num_docs, "eval_docs": prepared.cache.eval.num_docs,
        "eval_tokens": int(np.asarray(prepared.cache.eval.tokens, np.int64).sum()),
        "stories_read": prepared.cache.meta["stories_read"],
        "steps_per_epoch": data.steps_per_epoch,
        "tokenizer": prepared.tokenizer_info.fingerprint,
        "rows_read": sorted(set(rows_read)),
        "resumed_equal": all(np.array_equal(np.asarray(a[k]), np.asarray(b[k]))
                             for a, b in zip(after, again, strict=True) for k in a),
    }
    with open(f"{work_dir}/data{jax.process_index()}.json", "w") as f:
        json.dump(result, f)


def fsdp_across_processes(work_dir: str) -> None:
    import jax
    import numpy as np

    from gemmalab.model import mesh
    from gemmalab.train import params
    from gemmalab.weights import orbax_params
    from tests.helpers.models import _train

    losses, state = _train({"fsdp": -1}, jax.devices())
    device_mesh = mesh.make_mesh({"fsdp": -1})
    assert dict(device_mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    linear = state.params["layer_0"]["mlp"]["linear"]
    saved = orbax_params.save_params(state.params, f"{work_dir}/fsdp-params")
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.params)
    restored = orbax_params.load_params(saved, target=target)
    same = all(np.array_equal(np.asarray(a.data), np.asarray(b.data))
               for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored),
                               strict=True)
               for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True))
    result = {"losses": losses.tolist(), "restored_equal": same,
              "restored_sharding_equal": restored["layer_0"]["mlp"]["linear"].sharding
              == linear.sharding,
              "local_shard_shape": list(linear.addressable_shards[0].data.shape),
              "global_shape": list(linear.shape),
              # Each process sums its own shards; the sums are added up across processes.
              "digest": params.weights_digest(restored)}
    with open(f"{work_dir}/fsdp{jax.process_index()}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
