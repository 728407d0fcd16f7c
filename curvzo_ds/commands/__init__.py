"""One module per `curvzo-ds` command (cli.py owns the parser, the exit codes and the teardown)."""
