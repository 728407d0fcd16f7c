"""World-size-independent Gaussian or +-1 (perturbation=rademacher) noise: the key hash and the backend chooser
(gaussian), the row table's format and element modes (rows), and the kernels behind them: `reference` (torch eager,
any device: the definition), `cpu` (philox.c, compiled at first use), `gpu` (Triton, imported only when a tensor needs
it)."""
