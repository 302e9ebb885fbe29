"""Model-transparent mode: an unmodified script run under TorchPass (``python -m
torchpass.transparent.bootstrap SCRIPT``), the interposers and the session behind them. Imports torch."""
