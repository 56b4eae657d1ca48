"""What is asked: the cells of a diagnosis (implementation x dtype, for the model or as a what-if),
their accumulators, and the loops that feed them a tensor or an attention call."""
