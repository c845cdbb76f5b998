"""Inside a Ray Train worker: the entry, the worker's life (build, restore, fit, export), the loop,
checkpoints' save and restore, stop signals and telemetry."""
