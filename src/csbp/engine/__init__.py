"""The engine: applies a parallel layout to a model from the outside (rows, attention, loss, gradients)."""
