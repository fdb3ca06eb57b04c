"""gsm-edge bundles in Triton Inference Server: a model repository whose models run the gsm-edge engine in
Triton's Python backend (decoupled, the generate extension's inputs and outputs), and the GSM metrics on
Triton's own /metrics. `repository` writes it (`python -m runtime triton`), `model` is what Triton runs,
`launch` starts the `tritonserver` of the nvidia-pytriton package (tests, and this machine's own use)."""
