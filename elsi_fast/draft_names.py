"""The names of the draft's native weight precisions and decode backends (no torch import: the CLI's
choices and checks read them). `draft.native` maps the precisions to torch dtypes."""

DRAFT_WEIGHT_DTYPES = ("fp32", "bf16", "int8")
DRAFT_BACKENDS = ("auto", "native", "torch")
