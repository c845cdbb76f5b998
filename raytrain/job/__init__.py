"""The job: its spec (every section of the YAML), the rules that tie the sections together, and what
the driver resolves it to (the run plan). Torch-free and Ray-free: `raytrain validate`, the driver and
every worker read it; it imports only raytrain's leaves."""
