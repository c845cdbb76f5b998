"""The run directory: storage (local or a URI), the compare-and-swap record and the lease on it, signing,
the checkpoints' layout and the latest-checkpoint rule, the job file and the metrics backlog.
Torch-free: the driver, `raytrain export` and the workers all read and write it."""
