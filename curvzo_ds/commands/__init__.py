"""One module per `curvzo-ds` command: train, eval, export, plot, bench, plan, diagnose.

Each has `register(sub)`, which adds its parser to the subparsers `sub` with `set_defaults(handler=...)`; cli.py
builds the parser from them and owns the exit codes and the teardown. cli imports every command, so a command
module imports DeepSpeed and transformers inside its functions, not at its top. bench_timing.py is no command: the
bench suite's timings, reusable by benchmarks/; nor is plot_data.py: the runs plot reads.
"""
