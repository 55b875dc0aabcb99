"""Clover's test kit: what checks the product, kept out of the runtime (`clover_cpp` never
imports it when it runs a model).

* :mod:`clover_testkit.reference` - the numpy float64 reference model and decoding loop, the
  oracle the native code is held to;
* :mod:`clover_testkit.checkpoints` - deterministic synthetic checkpoints of any preset
  (``python -m clover_testkit.checkpoints``), the fixtures of the tests and benchmarks;
* :mod:`clover_testkit.bpe` - the fixture tokenizers: Qwen2-style byte-level BPE trained with
  Hugging Face ``tokenizers``.

The tests' shared harnesses live here too, so that no test module imports another:
:mod:`~clover_testkit.server_harness` (the servers the tests talk to),
:mod:`~clover_testkit.native_handles` (libclover through ctypes), :mod:`~clover_testkit.llama_tools`
(llama.cpp's tools), :mod:`~clover_testkit.gguf_files` and :mod:`~clover_testkit.fuzz` (GGUF
rewriters and mutators), :mod:`~clover_testkit.random_model` (the reference tests' random model),
:mod:`~clover_testkit.converted_gguf` (the converter tests' checkpoints and expected tensors),
:mod:`~clover_testkit.cli_runs` (the `clover` command run for the tests).
"""
