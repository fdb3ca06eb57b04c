"""GSM core: checkpoint format, checker, PyTorch golden model, dense -> GSM converter.

The contract is ../shared/GSM_SPEC.md; the decisions it leaves open are in docs/decisions.md.
"""

__version__ = "0.1.0"
