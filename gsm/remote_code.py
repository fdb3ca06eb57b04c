"""The `trust_remote_code` files every GSM checkpoint carries (gsm/hf_remote, docs/remote_code.md).

`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` finds the model classes through
config.json's `auto_map`, which names modules in DIR. Writers put the two standalone files of
gsm/hf_remote beside config.json and the returned `auto_map` into it.
"""

from __future__ import annotations

import os
from pathlib import Path

REMOTE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_gsm.py", "modeling_gsm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_gsm.GSMConfig",
    "AutoModelForCausalLM": "modeling_gsm.GSMForCausalLM",
}


def remote_code_files() -> dict[str, bytes]:
    """File name -> bytes of the remote-code files (the shape of write_checkpoint's extra_files)."""
    return {name: (REMOTE_DIR / name).read_bytes() for name in REMOTE_FILES}


def install_remote_code(checkpoint_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Copy the remote-code files into checkpoint_dir; returns the `auto_map` for its config.json.

    Meant for a directory still being written (the temp dir of atomic_output_dir): files added to
    a finished checkpoint are outside its manifest.
    """
    d = Path(checkpoint_dir)
    for name, data in remote_code_files().items():
        (d / name).write_bytes(data)
    return dict(AUTO_MAP)
