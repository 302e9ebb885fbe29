"""TorchPass: the training-side fault-tolerance library (planned: issue 6); nothing is implemented here yet."""
