"""Runtime: thin bundle loader (TensorRT on a GPU, ONNX Runtime anywhere). Never imports torch."""
