"""Weight-only quantization methods (vLLM's `--quantization`): the names and their checks."""

from __future__ import annotations

from typing import Optional

# vLLM's method names this engine implements. "none" is this engine's explicit opt-out: a .gguf
# model is then dequantized at load to --dtype (vLLM itself has no off value: omitting the flag
# means "whatever the checkpoint is", which for a .gguf file is "gguf").
QUANTIZATION_METHODS = ("gguf",)
QUANTIZATION_OFF = "none"


def resolve_quantization(quantization: Optional[str], is_gguf: bool) -> Optional[str]:
    """The method the engine runs: "gguf" or None (dense weights in --dtype).

    None (omitted) means "gguf" for a .gguf model and None otherwise; "none" forces dense
    weights. Raises ValueError naming `quantization` for an unknown value or a method the
    checkpoint cannot provide."""
    if quantization is None:
        return "gguf" if is_gguf else None
    if not isinstance(quantization, str):
        raise ValueError(f"quantization must be a string or None, got {quantization!r}.")
    method = quantization.lower()
    if method == QUANTIZATION_OFF:
        return None
    if method not in QUANTIZATION_METHODS:
        choices = ", ".join(repr(m) for m in (*QUANTIZATION_METHODS, QUANTIZATION_OFF))
        raise ValueError(
            f"quantization={quantization!r} is not supported; choose one of {choices} (or omit it)."
        )
    if method == "gguf" and not is_gguf:
        raise ValueError(
            "quantization='gguf' needs a .gguf model (a .gguf file, a directory holding one, "
            "or 'smollm2')."
        )
    return method
