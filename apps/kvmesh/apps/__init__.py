"""Apps on top of the components: the CLI, `kvmesh up`, the load generator."""
