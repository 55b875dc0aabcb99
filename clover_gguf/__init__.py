"""What the converter (clover_convert) and the runtime (clover_cpp) share, at the bottom of both
(as gguf-py's constants sit under llama.cpp's converter and tools): our GGUF key names
(:mod:`.keys`), the output-file rules (:mod:`.files`), the quantization types and the
importance-matrix format (:mod:`.quant`), the Clover GGUF reader check (:mod:`.reader`) and the
user-error base (:mod:`.errors`). It imports neither package above it; they never import each
other (tests/project/test_layering.py)."""
