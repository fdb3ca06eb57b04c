"""Sources of the `trust_remote_code` files every GSM checkpoint carries (see gsm.remote_code).

They are copied into checkpoints and run by transformers from its module cache, so they must stay
standalone: torch, transformers, the standard library and each other only.
"""
