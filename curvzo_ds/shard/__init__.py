"""The weights as one rank holds them: params and blocks, the passes over them (perturb), the bf16 visibility check,
the collectives and Topology (comm, distributed), and the DeepSpeed wing (ds_compat, ds_policy, ds_config). Planned
before a run: the memory one rank needs (memory; the prefetcher's replay in prefetch, the models' shapes in shapes)."""
