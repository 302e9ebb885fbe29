"""The `clockwork` command line: one module per command group."""
