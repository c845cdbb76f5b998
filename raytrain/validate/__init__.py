"""`raytrain validate`: the schema's problems, probes of the world (model files, data, storage,
MLflow) and the memory estimate, all before Ray is touched. Torch-free."""
