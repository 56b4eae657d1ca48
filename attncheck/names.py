"""Names users type on the command line, kept free of torch so that argument
checking stays fast. ``precision`` maps dtype names to torch dtypes."""

DTYPE_NAMES = ("fp16", "bf16", "fp32")
METHOD_NAMES = ("naive", "stable", "tiled", "torch")
METHOD_ALIASES = {"online": "tiled"}
DTYPE_ALIASES = {
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32", "float": "fp32",
}
ORDERS = ("forward", "reverse")
DEVICES = ("auto", "cpu", "cuda")
