"""Reading and writing weights: checkpoint headers and slices, model construction on the meta device, saving."""
