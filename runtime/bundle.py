"""Open a bundle for running: check its manifest hashes before trusting a single byte of it.

No torch here (the runtime installs with numpy + onnxruntime + tokenizers only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gsm.atomic import ManifestError, verify_manifest

BUNDLE_FORMAT = "gsm-edge-bundle"
BUNDLE_VERSION = 1


class BundleError(ValueError):
    """The bundle is missing, of another format, or a file fails its manifest hash."""


def verify_bundle(path: str | Path) -> dict[str, Any]:
    """Every file's sha256 against manifest.json, then the bundle fields; returns the manifest."""
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: no such bundle directory")
    try:
        problems = verify_manifest(root)
    except ManifestError as e:
        raise BundleError(f"{root}: {e}") from None
    if problems:
        raise BundleError(f"{root}: bundle integrity check failed (rebuild it with `python -m builder build`):\n  "
                          + "\n  ".join(problems))
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    if manifest.get("bundle_format") != BUNDLE_FORMAT:
        raise BundleError(f"{root}: not a {BUNDLE_FORMAT} (bundle_format {manifest.get('bundle_format')!r})")
    if manifest.get("bundle_version") != BUNDLE_VERSION:
        raise BundleError(f"{root}: bundle version {manifest.get('bundle_version')!r}, this runtime reads "
                          f"{BUNDLE_VERSION}")
    return manifest
