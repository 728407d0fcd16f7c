"""Checkpoints without an optimizer: what each rank saves and how it is verified and published, and the manager
that saves on schedule and resolves `--resume`."""
