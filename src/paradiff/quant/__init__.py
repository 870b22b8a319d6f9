"""Weight quantization on each rank's slice (mechanism): the scheme a diffusers config asks for (`schemes.py`) and
quantizing the linears a rank holds so that each shard equals the slice of the single-device quantized weight
(`apply.py`)."""
