"""World-size-independent Gaussian noise: the key hash, the row table's layout, the backend chooser (gaussian), and
the kernels behind it: `reference` (torch eager, any device: the definition), `cpu` (philox.c, compiled at first use),
`gpu` (Triton, imported only when a CUDA tensor needs it)."""
