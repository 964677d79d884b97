"""Export to an on-device runtime: ONNX Runtime (``wiola export --format onnx``).

- ``wiola.export.step``: ``DecodeStep``, one decoding step as a traceable tensor function
  (fp32, or int8/bf16 weights as ``wiola.fast.quantize`` packs them);
- ``wiola.export.onnx``: ``export_onnx``, the step as ``model.onnx`` plus the tokenizer;
- ``wiola.export.runner``: ``OnnxModel`` and ``StepDriver``, numpy and ``onnxruntime`` only,
  copied into every export as ``run_onnx.py``.

Why ONNX Runtime and not ExecuTorch: ``docs/SPEC.md`` (On-device export) and
``bench/results/2026-11-30_cpu_export-runtimes/``.
"""
