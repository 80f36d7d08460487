"""Drafter -> edge bundle export (to_onnx) and the ONNX Runtime draft-step benchmark (bench_ort)."""
