"""The names of the native ops' weight precisions (the draft's decode step and the target runtime
pack weights the same three ways) and of the draft's decode backends. No torch import: the CLI's
choices and checks read them; `elsi_fast._extension` maps the precisions to torch dtypes."""

NATIVE_WEIGHT_DTYPES = ("fp32", "bf16", "int8")
DRAFT_BACKENDS = ("auto", "native", "torch")
