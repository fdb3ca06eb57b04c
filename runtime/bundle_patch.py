"""`python -m runtime patch BUNDLE --patch PATCH.json [--out DIR]`: change a bundle's run-time knobs without a rebuild.

The patch is RFC 6902 over bundle.json's paths, the knobs of gsm.bundle_knobs only (a field tied to a graph is
refused with the `builder build` flag that makes it anew). The bundle's hashes are checked first (a modified bundle
is not re-signed), the patched bundle.json is parsed and held to the limits the graphs and memory plan were built
for, and the new directory, its manifest re-hashed, is renamed into place (gsm.atomic): a refusal writes nothing.
Patching in place hard-links the other files into the new directory (nothing copied); --out copies them.
The golden probe keeps the knobs it was recorded with, so `runtime verify` judges the graphs, not the patch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gsm.atomic import MANIFEST_NAME, atomic_output_dir, is_inside, place_file
from gsm.bundle_format import FILES, BundleConfig, BundleError
from gsm.bundle_knobs import KnobError, RunKnobs, apply_operations, check_operations, knobs_of_document
from runtime.bundle import verify_bundle

MANIFEST_OWN = ("format", "version", "files")  # what write_manifest writes itself; the rest is the bundle's identity
KNOBS_CHECKSUM = "knobs_checksum"  # manifest field: the knob document's checksum after the last patch


@dataclass(frozen=True)
class BundlePatch:
    out: Path
    checksum: str  # of the knob document now in the bundle
    changed: tuple[str, ...]  # the paths the patch touched


def patched_config(bundle: Path, ops: Any) -> tuple[dict[str, Any], RunKnobs]:
    """(bundle.json as patched, the knobs it states): KnobError naming the path unless every operation addresses a
    knob and the result is in range and within the bundle's limits. The patch applies to bundle.json as the builder
    writes it (BundleConfig.to_json: a section the file lacks, such as run_time, at its defaults)."""
    old = BundleConfig.load(bundle)
    doc = apply_operations(old.to_json(), check_operations(ops))
    knobs = knobs_of_document(doc, old.kv_quantization)  # each knob's range, named by its path
    try:
        BundleConfig.from_json(doc, str(bundle / FILES.config))
    except BundleError as e:
        raise KnobError(f"after the patch: {e}") from None
    old.knob_limits.check(knobs)
    return doc, knobs


def patch_bundle(src: Path, ops: Any, out: Path | None = None, *, overwrite: bool = False) -> BundlePatch:
    """Apply `ops` to bundle `src`, written to `out` (a copy) or over `src`."""
    src = Path(src)
    manifest = verify_bundle(src)  # BundleError: not a bundle, or files that no longer match their hashes
    doc, knobs = patched_config(src, ops)
    in_place = out is None or Path(out).resolve() == src.resolve()
    dest = src if in_place else Path(out)
    if not in_place and (is_inside(src.resolve(), dest.resolve()) or is_inside(dest.resolve(), src.resolve())):
        raise KnobError(f"--out {out} is inside {src} or contains it; pass a separate directory")
    extra = {k: v for k, v in manifest.items() if k not in MANIFEST_OWN}
    extra[KNOBS_CHECKSUM] = knobs.checksum
    with atomic_output_dir(dest, overwrite=in_place or overwrite, manifest_extra=extra) as tmp:
        for dirpath, _dirs, files in os.walk(src, followlinks=False):
            for name in sorted(files):
                f = Path(dirpath) / name
                rel = f.relative_to(src)
                if rel.as_posix() in (FILES.config, MANIFEST_NAME) or not f.is_file():
                    continue
                place_file(f, tmp / rel, link=in_place and not f.is_symlink())
        (tmp / FILES.config).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        BundleConfig.load(tmp)  # what the runtime will read
    return BundlePatch(dest, knobs.checksum, tuple(str(o.get("path")) for o in ops))


def read_patch(path: Path) -> Any:
    """The operations of a --patch file; KnobError naming the file otherwise."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KnobError(f"--patch {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise KnobError(f"--patch {path}: not a JSON file ({e})") from None
