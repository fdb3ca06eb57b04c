"""Builder: GSM checkpoint -> deployable bundle (ONNX with GSM plugin nodes, portable ONNX, memory plan).

Arrives with the builder issue; it uses `gsm` and never the other way round.
"""
