"""The noise generator's kernels: `reference` (torch eager, any device: the definition), `cpu` (philox.c,
compiled at first use), `gpu` (Triton, imported only when a CUDA tensor needs it). noise.py dispatches."""
