"""Writes a GGUF file's quantized matrices in another block type (for example the SmolLM2 package's
Q4_1 file as Q8_0), every other tensor and all metadata unchanged, with the `gguf` package's own
quantizer. The new file's weights are the old file's dequantized weights rounded again, so it is a
fair same-weights comparison between engines, not the original model at a higher precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# general.file_type of a file whose matrices are all of one type (llama.cpp's LLAMA_FTYPE values).
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def requantize_gguf(source: str | Path, destination: str | Path, block_type: str = "Q8_0") -> Path:
    """Copies `source` to `destination` with every 2-D quantized tensor in `block_type`."""
    import gguf

    if block_type not in FILE_TYPES:
        raise ValueError(f"block_type: {block_type!r} is not one of {', '.join(FILE_TYPES)}")
    qtype = gguf.GGMLQuantizationType[block_type]
    reader = gguf.GGUFReader(str(source), "r")
    arch = reader.fields["general.architecture"].contents()
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value = FILE_TYPES[block_type] if key == "general.file_type" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or len(tensor.shape) != 2:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=kind)
            continue
        dense = gguf.quants.dequantize(np.asarray(tensor.data), kind)
        writer.add_tensor(tensor.name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(destination)
    return destination
