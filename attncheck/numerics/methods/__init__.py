"""How each implementation computes: the softmax methods, the attention paths and FP8, each with
the rounding points of the code it names."""
