"""The weights as one rank holds them: params and blocks, the passes of a step over them (perturb, its row table in
row_table; a static mask's in mask), the forwards and the step's one all-reduce (forwards), the bf16 visibility
check, the weights' digest (digest), the collectives and Topology (comm, distributed), and DeepSpeed's privates
(ds_compat). Where the weights live is decided in layout/."""
