"""Per-step attention metadata. Every field is a tensor or a plain int, so stage 0 can build it
once and send it down the pipeline with the hidden states (see communication.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class InputMetadata:
    """Where each token of the flat batch goes in the paged KV cache and what it attends to.

    The batch is flattened: first the prefill tokens of `num_prefills` sequences (back to back),
    then one token per decoding sequence. A prefill may start after tokens whose KV is already
    in the cache (a later chunk of a chunked prefill, or a prompt whose prefix was found in the
    prefix cache): its queries then attend over that cached context too.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # [num_tokens] int64: flat cache slot (block * block_size + offset) of each token.
    slot_mapping: torch.Tensor
    # [num_prefills] int64: token count of each prefill sequence.
    prefill_seq_lens: torch.Tensor
    # [num_decodes] int64: tokens in context (including the new one) of each decoding sequence.
    decode_context_lens: torch.Tensor
    # [num_decodes, max_blocks] int64: block tables of the decoding sequences, zero-padded.
    decode_block_tables: torch.Tensor
    # [num_prefills] int64: tokens of each prefill sequence already in the cache (its context).
    prefill_context_lens: torch.Tensor | None = None
    # [num_prefills, max_blocks] int64: block tables of the prefills, zero-padded; [0, 0] when
    # no prefill has a cached context (the plain prefill path reads no cache).
    prefill_block_tables: torch.Tensor | None = None
    # [num_prefills] int64: tokens of each prefill sequence at this step (cached, in this step
    # and in later chunks): rope variants that switch on the sequence length see it (rotary.py).
    prefill_total_lens: torch.Tensor | None = None
    # [num_tokens] int64: each token's segment id for encoder pair inputs (None: none). Read
    # by the first stage's embeddings only, so it is not sent down the pipeline.
    token_type_ids: torch.Tensor | None = None
    # Python copies of small tensors, derived once per step so layers do not sync per call.
    _prefill_lens_list: list[int] | None = field(default=None, repr=False)
    _decode_max_len: int | None = field(default=None, repr=False)
    _prefill_context_list: list[int] | None = field(default=None, repr=False)

    _INT_FIELDS = ("num_prefills", "num_prefill_tokens", "num_decode_tokens")
    _TENSOR_FIELDS = (
        "slot_mapping",
        "prefill_seq_lens",
        "decode_context_lens",
        "decode_block_tables",
        "prefill_context_lens",
        "prefill_block_tables",
        "prefill_total_lens",
    )

    def __post_init__(self) -> None:
        if self.prefill_context_lens is None:
            self.prefill_context_lens = torch.zeros(self.num_prefills, dtype=torch.long)
        if self.prefill_block_tables is None:
            self.prefill_block_tables = torch.zeros(0, 0, dtype=torch.long)
        if self.prefill_total_lens is None:  # what the step holds of each sequence
            self.prefill_total_lens = self.prefill_context_lens + self.prefill_seq_lens

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def prefill_lens(self) -> list[int]:
        if self._prefill_lens_list is None:
            self._prefill_lens_list = self.prefill_seq_lens.tolist()
        return self._prefill_lens_list

    @property
    def prefill_context_list(self) -> list[int]:
        """Cached context length of each prefill (all zero for plain prompts)."""
        if self._prefill_context_list is None:
            assert self.prefill_context_lens is not None
            self._prefill_context_list = self.prefill_context_lens.tolist()
        return self._prefill_context_list

    @property
    def decode_max_len(self) -> int:
        if self._decode_max_len is None:
            lens = self.decode_context_lens
            self._decode_max_len = int(lens.max()) if lens.numel() else 0
        return self._decode_max_len

    def to_dict(self, prefix: str = "md.") -> dict[str, Any]:
        """Flatten into a sendable dict (plain ints and tensors only)."""
        out: dict[str, Any] = {prefix + name: getattr(self, name) for name in self._INT_FIELDS}
        out.update({prefix + name: getattr(self, name) for name in self._TENSOR_FIELDS})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str = "md.") -> InputMetadata:
        kwargs = {name: data[prefix + name] for name in cls._INT_FIELDS + cls._TENSOR_FIELDS}
        return cls(**kwargs)
