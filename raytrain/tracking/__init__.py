"""MLflow and the start-up record: the driver's run (one per job), rank 0's step-metrics writer,
and the phases before step 1. Torch-free."""
