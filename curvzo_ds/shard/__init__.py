"""The weights as one rank holds them: params and blocks, the passes over them (perturb), the bf16 visibility check,
the collectives and Topology (comm, distributed), and the DeepSpeed wing (ds_compat, ds_policy, ds_config)."""
