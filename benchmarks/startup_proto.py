"""P2's prototype inside raytrain's workers: start the data pipeline before building the model.

raytrain's worker builds the model, restores, and only then creates `GlobalBatches`, whose
first `next()` starts Ray Data's iteration: the pipeline's start-up (its tasks' processes,
tokenizer loading, the first window of `data.shuffle_window` packed rows) runs after the
model build instead of beside it. This prototype starts the iteration of the `train` shard
on a thread as the worker begins (at its first call, `load_tokenizer`) and hands that same
iterator, first window already in, to `GlobalBatches` when it asks for the shard. The
rows and their order are unchanged: it is the same iterator, only started earlier.
"""

from __future__ import annotations

import queue
import threading


def install() -> None:
    import ray.train
    import torch

    from raytrain import modeling

    original_tokenizer = modeling.load_tokenizer
    original_shard = ray.train.get_dataset_shard
    early: dict = {}

    def load_tokenizer(spec):
        if "iterator" not in early:  # the worker's first call: start the data beside everything after it
            shard = original_shard("train")
            iterator = iter(shard.iter_torch_batches(batch_size=spec.data.shuffle_window, dtypes=torch.long,
                                                     prefetch_batches=2))
            first: queue.Queue = queue.Queue(maxsize=1)

            def pull() -> None:
                try:
                    first.put(("window", next(iterator)))
                except BaseException as exc:  # handed to the training thread, raised there
                    first.put(("error", exc))

            threading.Thread(target=pull, name="early-data", daemon=True).start()
            early.update(shard=shard, iterator=iterator, first=first, window=spec.data.shuffle_window)
        return original_tokenizer(spec)

    def continued():
        kind, value = early["first"].get()
        if kind == "error":
            raise value
        yield value
        yield from early["iterator"]

    class Shard:
        """The shard GlobalBatches gets: its first epoch continues the early iteration."""

        def __init__(self):
            self.used = False

        def iter_torch_batches(self, **kwargs):
            if self.used or kwargs.get("batch_size") != early["window"]:
                return early["shard"].iter_torch_batches(**kwargs)  # later epochs: a fresh pass, as before
            self.used = True
            return continued()

    def get_dataset_shard(name: str = "train"):
        return Shard() if name == "train" and "shard" in early else original_shard(name)

    modeling.load_tokenizer = load_tokenizer
    ray.train.get_dataset_shard = get_dataset_shard
