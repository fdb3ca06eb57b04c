"""What each precision is held to against the golden probe (docs/verify.md "Tolerances", decisions "Golden probe
tolerances"). Never torch: the runtime imports this.

A precision is the arithmetic a backend runs a bundle with, not the bundle's weight format: the golden already runs
on the bundle's own (dequantised) weights, so what is left is what the golden does not model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32, INT8_ACTIVATIONS, FP16 = "fp32", "int8-activations", "fp16"
EXCUSED_SHARE = 0.25  # of a probe's outputs, at most, may be excused as near-tie re-selections


@dataclass(frozen=True)
class Tolerance:
    """Limits of one precision, per output, in units of its logit scale (the golden's largest |logit| there), on the
    logits centred on the output's mean difference (a shift common to a whole row changes no probability):
    max |dlogit| <= abs + rel x scale and mean |dlogit| <= mean_abs + mean_rel x scale, each plus the float16
    rounding of the stored golden; the selection overlap (Jaccard, rows where the golden's selection is sparse) of
    the worst layer at least `overlap`; an output whose golden top-k boundary gap (relative to its largest index
    score) is below `sel_gap` may be re-selected by this arithmetic, and so may be excused."""

    name: str
    abs: float
    rel: float
    mean_abs: float
    mean_rel: float
    overlap: float
    sel_gap: float
    what: str  # the arithmetic it covers, one line

    def max_limit(self, scale: np.ndarray) -> np.ndarray:
        return self.abs + self.rel * np.asarray(scale, np.float64)

    def mean_limit(self, scale: np.ndarray) -> np.ndarray:
        return self.mean_abs + self.mean_rel * np.asarray(scale, np.float64)

    def words(self) -> str:
        return (f"max |dlogit| <= {self.abs:g} + {self.rel:g} x scale, mean <= {self.mean_abs:g} + {self.mean_rel:g} "
                f"x scale, selection overlap >= {self.overlap:g} ({self.what}; docs/verify.md)")


TOLERANCES = {
    FP32: Tolerance(FP32, abs=1e-3, rel=3e-3, mean_abs=1e-4, mean_rel=5e-4, overlap=0.97, sel_gap=1e-4,
                    what="float32 activations on the golden's weights: summation order, FP16 cache rows one ulp apart"),
    INT8_ACTIVATIONS: Tolerance(INT8_ACTIVATIONS, abs=0.05, rel=0.07, mean_abs=0.01, mean_rel=0.01, overlap=0.93,
                                sel_gap=0.05, what="INT8 activation blocks of the quantised matmuls (ONNX Runtime "
                                                   "accuracy level 4), emulated by the golden, whose rounding flips "
                                                   "cascade through the layers"),
    FP16: Tolerance(FP16, abs=0.01, rel=0.03, mean_abs=2e-3, mean_rel=8e-3, overlap=0.93, sel_gap=0.02,
                    what="FP16 activations and FP16 copies of the float weights (TensorRT, the plugin reference), "
                         "which the golden does not model"),
}
