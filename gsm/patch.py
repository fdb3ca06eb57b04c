"""`python -m gsm patch DIR --patch PATCH.json [--out DIR2]`: change a checkpoint's run-time knobs in place.

Needs the `builder` extra (the checker's safetensors). The published GSM description lets a deployment
change `gsm_config` by a JSON Patch (RFC 6902) and re-verify the checksum afterwards. A patch here addresses one
document, `{"gsm_config": <config.json's gsm_config>, "kv_quantization": <quant_config.json's kv_quantization>}`, so
its paths read `/gsm_config/sparse_window` or `/kv_quantization/tier_fractions`. Only the knobs in KNOBS may change:
the others are tied to tensor shapes or to the conversion and calibration that made them (NEEDS_REBUILD says why,
and which command makes them anew). After the patch the checksum is recomputed, both configs are parsed (their
ranges), the checker runs over the new directory, and only then is it renamed into place (gsm.atomic): a refusal at
any step writes nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gsm.atomic import MANIFEST_NAME, ManifestError, atomic_output_dir, place_file, verify_manifest
from gsm.bundle_knobs import KnobError, apply_operations
from gsm.checkpoint import CONFIG_FILE, QUANT_FILE
from gsm.config import ConfigError, KVQuantConfig, ModelConfig, gsm_checksum

GSM, KVQ = "gsm_config", "kv_quantization"
# the knobs a patch may change, by section: what each is (its range is the config's own check, gsm.config)
KNOBS: dict[str, dict[str, str]] = {
    GSM: {
        "sparse_window": "the selection's recent window",
        "max_sparse_window": "the largest window a request or a bundle may ask for",
        "sparse_top_k": "the indexer's budget",
        "sparse_top_k_divisor": "the budget's growth with the context",
        "sink_tokens": "the always-kept first positions",
        "layer_selection": "each owning layer's own window and budget",
        "quantization_adaptation_rate": "decode steps between re-tier passes",
    },
    KVQ: {
        "tier_fractions": "the share of positions kept at each precision",
        "fp16_window": "the last positions kept FP16",
        "hotness_decay": "the hotness average's decay",
        "hot_token_ids": "token ids always kept FP16",
    },
}
_RECONVERT = "python -m gsm convert (a new conversion)"
_RECALIBRATE = "python -m calibration run (a new calibration)"
# the fields a patch may not change, and what makes them anew
NEEDS_REBUILD: dict[str, dict[str, str]] = {
    GSM: {
        "indexer_heads": f"the indexer's tensor shapes: {_RECONVERT}",
        "indexer_dim": f"the indexer's tensor shapes: {_RECONVERT}",
        "kv_compression_ratio": f"the latent ranks of k_svd_U / v_svd_U: {_RECONVERT}",
        "kv_compression_tolerance": f"the conversion's choice of ranks: {_RECONVERT}",
        "shared_layers": f"the sharing map and its kv_projector tensors: {_RECONVERT}",
        "kv_sharing": f"the sharing map and its kv_projector tensors: {_RECONVERT}",
        "shared_layer_grouping": f"the sharing map: {_RECONVERT}",
        "checksum": "the patch recomputes it",
    },
    KVQ: {
        "scheme": f"the calibration's tables: {_RECALIBRATE}",
        "bit_widths": "the tiers the fractions name (tier_fractions sets them)",
        "index_key_bits": f"the calibrated indexer-key scales: {_RECALIBRATE}",
        "method": f"the calibration's provenance: {_RECALIBRATE}",
        "samples": f"the calibration's provenance: {_RECALIBRATE}",
        "data_hash": f"the calibration's provenance: {_RECALIBRATE}",
    },
}


class PatchError(ValueError):
    """A patch that cannot be applied: the message names the operation's path and the reason."""


@dataclass(frozen=True)
class PatchResult:
    out: Path
    checksum: str  # gsm_config.checksum after the patch
    changed: tuple[str, ...]  # the paths the patch touched


def _check_field(path: str, op: int, key: str) -> None:
    """Refuse a patch path unless it addresses a knob (or inside one)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise PatchError(f"operation {op}: {key} {path!r} is not a JSON pointer (expected '/gsm_config/<field>' or "
                         "'/kv_quantization/<field>')")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    if len(parts) < 2 or parts[0] not in KNOBS:
        raise PatchError(f"operation {op}: {key} {path!r} is outside the knobs (expected '/gsm_config/<field>' or "
                         "'/kv_quantization/<field>')")
    section, name = parts[0], parts[1]
    if name in NEEDS_REBUILD[section]:
        raise PatchError(f"{path}: {section}.{name} cannot change in place ({NEEDS_REBUILD[section][name]})")
    if name not in KNOBS[section]:
        raise PatchError(f"{path}: {section}.{name} is not a knob a patch may change (knobs: "
                         f"{', '.join(sorted(KNOBS[section]))})")


def check_operations(ops: Any) -> None:
    """Refuse (PatchError) anything but a well-formed RFC 6902 patch whose every operation addresses a knob."""
    import jsonpatch

    if not isinstance(ops, list) or not ops:
        raise PatchError("the patch must be a non-empty JSON array of operations (RFC 6902)")
    try:
        jsonpatch.JsonPatch(ops)._ops  # noqa: B018 - parses every operation (op names, required members)
    except (jsonpatch.InvalidJsonPatch, jsonpatch.JsonPointerException, TypeError, KeyError) as e:
        raise PatchError(f"the patch is not a valid JSON Patch: {e}") from None
    for i, o in enumerate(ops):
        _check_field(o.get("path"), i, "path")
        if o.get("op") in ("move", "copy"):
            _check_field(o.get("from"), i, "from")


def apply_patch(config: dict[str, Any], quant: dict[str, Any], ops: list[dict[str, Any]]) -> tuple[dict, dict]:
    """(config.json, quant_config.json) with the patch applied and gsm_config.checksum recomputed, both parsed by
    their configs (ranges); PatchError naming the path or field otherwise. The inputs are not modified."""
    check_operations(ops)
    try:
        new = apply_operations({GSM: config.get(GSM, {}), KVQ: quant.get(KVQ, {})}, ops)
    except KnobError as e:
        raise PatchError(str(e)) from None
    gc = {k: v for k, v in new[GSM].items() if k != "checksum"}
    gc["checksum"] = gsm_checksum(gc)
    config, quant = {**config, GSM: gc}, {**quant, KVQ: new[KVQ]}
    try:
        model = ModelConfig.from_json(config)
        kv = KVQuantConfig.from_json(quant)
    except ConfigError as e:
        raise PatchError(f"after the patch: {e}") from None
    bad = [t for t in kv.hot_token_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise PatchError(f"/{KVQ}/hot_token_ids: {bad[:5]} outside the vocabulary [0, {model.vocab_size})")
    return config, quant


def patch_checkpoint(src: Path, ops: list[dict[str, Any]], out: Path | None = None, *,
                     overwrite: bool = False) -> PatchResult:
    """Apply `ops` to checkpoint `src`, written to `out` (a copy) or over `src` (its other files hard-linked into
    the new directory); the checker must pass on the result before it is renamed into place."""
    from gsm.checker import verify

    src = Path(src)
    for name in (CONFIG_FILE, QUANT_FILE):
        if not (src / name).is_file():
            raise PatchError(f"{src / name}: missing (a GSM checkpoint has config.json and quant_config.json)")
    if (src / MANIFEST_NAME).exists():
        try:
            problems = verify_manifest(src)
        except ManifestError as e:
            raise PatchError(f"{src}: {e}") from None
        if problems:
            raise PatchError(f"{src}: files do not match {MANIFEST_NAME} ({'; '.join(problems[:3])}); refusing to "
                             "re-sign a modified checkpoint (python -m gsm verify)")
    config = json.loads((src / CONFIG_FILE).read_text(encoding="utf-8"))
    quant = json.loads((src / QUANT_FILE).read_text(encoding="utf-8"))
    config, quant = apply_patch(config, quant, ops)
    in_place = out is None or Path(out).resolve() == src.resolve()
    dest = src if in_place else Path(out)
    if not in_place and (dest.resolve().is_relative_to(src.resolve()) or src.resolve().is_relative_to(dest.resolve())):
        raise PatchError(f"--out {out} is inside {src} or contains it; pass a separate directory")
    with atomic_output_dir(dest, overwrite=in_place or overwrite) as tmp:
        for dirpath, _dirs, files in os.walk(src, followlinks=False):
            for name in sorted(files):
                f = Path(dirpath) / name
                rel = f.relative_to(src)
                if rel.as_posix() in (CONFIG_FILE, QUANT_FILE, MANIFEST_NAME) or not f.is_file():
                    continue
                place_file(f, tmp / rel, link=in_place and not f.is_symlink())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / QUANT_FILE).write_text(json.dumps(quant, indent=2) + "\n", encoding="utf-8")
        report = verify(tmp)
        if not report.ok:
            first = report.errors[0]
            raise PatchError(f"after the patch the checker refuses the checkpoint: {first.code}: {first.message}")
    return PatchResult(dest, config[GSM]["checksum"], tuple(o["path"] for o in ops))


def patch_command(src: str, patch_file: str, out: str | None, overwrite: bool) -> int:
    path = Path(patch_file)
    try:
        ops = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PatchError(f"--patch {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise PatchError(f"--patch {path}: not JSON ({e})") from None
    r = patch_checkpoint(Path(src), ops, Path(out) if out else None, overwrite=overwrite)
    print(f"patched {r.out}: {', '.join(r.changed)}; gsm_config.checksum {r.checksum} (checker passed)")
    return 0
