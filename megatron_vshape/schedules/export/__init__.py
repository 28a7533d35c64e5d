"""Schedules and simulations out of the project: text grids, pictures, Chrome traces, PyTorch's CSV."""
