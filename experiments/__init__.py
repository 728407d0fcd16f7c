"""The experiments: each a module run as `python -m experiments.<name>` from the repository's root, all of whose runs go
through one core (`experiments.core.run_curve`, its cache and provenance record); docs/architecture.md's
"experiments/" section says where an arm and a metric go, and experiments/RESULTS.md what they found."""
