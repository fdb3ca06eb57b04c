"""Open a bundle for running: check its manifest hashes before trusting a single byte of it, then read
bundle.json once (gsm.bundle_format declares both sides of the format).

No torch here (the runtime installs with numpy + onnxruntime + tokenizers only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gsm.atomic import MANIFEST_NAME, ManifestError, read_manifest, verify_manifest
from gsm.bundle_format import REBUILD, BundleConfig, BundleError, check_identity

__all__ = ["BundleConfig", "BundleError", "open_bundle", "verify_bundle"]

BUILD_FROM = "python -m builder build --device orin --checkpoint {src} --output BUNDLE"


def verify_bundle(path: str | Path) -> dict[str, Any]:
    """The bundle fields of the manifest, then every file's sha256 against it; returns the manifest."""
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: no such bundle directory")
    try:
        read_manifest(root)
    except ManifestError as e:
        if not (root / MANIFEST_NAME).exists():
            raise BundleError(not_a_bundle(root)) from None
        raise BundleError(f"{root}: {e}") from None
    manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    if "bundle_format" not in manifest:  # a manifest gsm-edge wrote for something else (a checkpoint)
        raise BundleError(not_a_bundle(root))
    check_identity(root, manifest)
    problems = verify_manifest(root)
    if problems:
        raise BundleError(f"{root}: bundle integrity check failed (rebuild it with `{REBUILD}`):\n  "
                          + "\n  ".join(problems))
    return manifest


def open_bundle(path: str | Path) -> tuple[dict[str, Any], BundleConfig]:
    """The verified manifest and bundle.json, parsed once: what runtime.load hands to the backends."""
    manifest = verify_bundle(path)
    return manifest, BundleConfig.load(Path(path))


def not_a_bundle(root: Path) -> str:
    """What a directory without a bundle manifest is, and the command that makes a bundle from it."""
    from gsm.checkpoint import CONFIG_FILE, QUANT_FILE

    try:
        config = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        config = None
    if isinstance(config, dict) and "gsm_config" in config:
        return (f"{root}: a GSM checkpoint ({CONFIG_FILE} with gsm_config"
                + (f", {QUANT_FILE}" if (root / QUANT_FILE).is_file() else "") + "), not a bundle; make a bundle "
                f"from it with `{BUILD_FROM.format(src=root)}`")
    if isinstance(config, dict):
        return (f"{root}: a model directory ({CONFIG_FILE} without gsm_config), not a GSM checkpoint or a bundle; "
                f"convert it with `python -m gsm convert --from hf {root} --out CHECKPOINT`, then "
                f"`{BUILD_FROM.format(src='CHECKPOINT')}`")
    return (f"{root}: not a bundle (no {MANIFEST_NAME} with bundle_format, no {CONFIG_FILE}); a bundle is made "
            f"from a GSM checkpoint with `{BUILD_FROM.format(src='CHECKPOINT')}`")
