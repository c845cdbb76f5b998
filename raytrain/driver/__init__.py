"""The driver of `raytrain run`: Ray, the MLflow run, the lease, the token stores, Ray Train's trainer.
Torch-free: the workers' code is imported only inside their processes."""
