"""The names of the native ops' weight precisions (the draft's decode step and the target runtime
pack weights the same three ways), of the draft's decode backends and of the draft trainer's
precisions. No torch import: the CLI's choices and checks read them; `elsi_fast._infra._extension` maps
the precisions to torch dtypes."""

NATIVE_WEIGHT_DTYPES = ("fp32", "bf16", "int8")
DRAFT_BACKENDS = ("auto", "native", "torch")
TRAINING_PRECISIONS = ("auto", "float32", "bfloat16")
