"""Scheduler output -> input tensors (first stage), run this stage's layers, sample (last stage).

One batched forward per step: prefill tokens of all prompt groups back to back, then one token
per decoding sequence; there is no per-sequence loop around the layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.distributed import parallel_state as ps
from vllm.lora.worker_manager import StageLoRAManager, token_lora_ids
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.attention import KVCache
from vllm.model_executor.layers.pooler import PoolingBuffer, PoolingStateLost, pool
from vllm.model_executor.layers.sampler import Sampler
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.sampling_metadata import build_sampling_metadata
from vllm.sequence import SamplerOutput, SequenceGroupMetadata, SequenceGroupOutput
from vllm.spec_decode.verify import accept_drafts
from vllm.structured_output.compiler import compile_cache_for
from vllm.structured_output.matcher import StructuredOutputState
from vllm.worker.request_table import StepRows


def prepare_inputs(
    layout: list[SequenceGroupMetadata], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, InputMetadata]:
    """Flatten a step's groups, in the batch layout (`StepRows.layout`: prefills first, then
    decodes), into input_ids [T], positions [T] and the attention metadata."""
    input_ids: list[int] = []
    positions: list[int] = []
    type_ids: list[int] = []  # token_type_ids (encoder pair inputs), when a prompt has them
    slots: list[int] = []
    prefill_lens: list[int] = []
    prefill_contexts: list[int] = []
    total_lens: list[int] = []
    prefill_tables: list[list[int]] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []

    def add_decode_row(token: int, pos: int, table: list[int]) -> None:
        """One token at `pos` attending over positions 0..pos through `table` (a decode, or
        one position of a speculative decode)."""
        input_ids.append(token)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        context_lens.append(pos + 1)
        tables.append(table)

    def add_chunk(tokens: list[int], start: int, table: list[int], total_len: int) -> None:
        """Tokens fed at positions start.. after `start` cached ones (a prompt, a chunk of
        one, or the part after a cached prefix)."""
        end = start + len(tokens)
        input_ids.extend(tokens)
        positions.extend(range(start, end))
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        prefill_lens.append(len(tokens))
        prefill_contexts.append(start)
        total_lens.append(total_len)
        prefill_tables.append(table)

    for meta in layout:  # prefills first, so one pass puts their tokens ahead of decodes
        if meta.draft_token_ids is not None or not meta.is_prompt:
            # A decode: each sequence feeds its last token and, speculating, its k drafts
            # (positions len-1 .. len-1+k) as k+1 decode rows over its own block table. Every
            # token's K/V is written to the cache before attention runs, so row i, reading
            # context len+i, sees the drafts before it and none after: causal, as a prefill
            # chunk would be, on the decode kernel instead of a gather of the whole context.
            drafts = meta.draft_token_ids or {}
            for seq_id, data in meta.seq_data.items():
                table = meta.block_tables[seq_id]
                tokens = [data.get_last_token_id(), *drafts.get(seq_id, ())]
                for pos, token in enumerate(tokens, start=data.get_len() - 1):
                    add_decode_row(token, pos, table)
            continue
        for seq_id, data in meta.seq_data.items():
            # A prompt (or a recompute-preempted sequence) feeds its tokens after the ones
            # already in the cache: all of them, one chunk, or the part after a cached prefix.
            start = data.get_num_computed_tokens()
            length = data.get_len() - start
            if len(meta.seq_data) == 1 and meta.token_chunk_size is not None:
                length = meta.token_chunk_size
            if data.token_type_ids is not None:
                # Placed at the token's index in the batch (a decode's is filled with 0 below).
                type_ids.extend([0] * (len(input_ids) - len(type_ids)))
                type_ids.extend(data.token_type_ids[start : start + length])
            tokens = data.get_token_ids()[start : start + length]
            add_chunk(tokens, start, meta.block_tables[seq_id], data.get_len())

    def long_tensor(values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    max_blocks = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    if any(prefill_contexts):
        width = max(len(t) for t in prefill_tables)
        prefill_padded = [t + [0] * (width - len(t)) for t in prefill_tables]
        prefill_block_tables = long_tensor(prefill_padded).view(len(prefill_padded), width)
    else:
        prefill_block_tables = torch.zeros(0, 0, dtype=torch.long, device=device)

    md = InputMetadata(
        num_prefills=len(prefill_lens),
        num_prefill_tokens=sum(prefill_lens),
        num_decode_tokens=len(context_lens),
        slot_mapping=long_tensor(slots),
        prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.long),
        decode_context_lens=long_tensor(context_lens),
        decode_block_tables=long_tensor(padded).view(len(padded), max_blocks),
        prefill_context_lens=torch.tensor(prefill_contexts, dtype=torch.long),
        prefill_block_tables=prefill_block_tables,
        prefill_total_lens=torch.tensor(total_lens, dtype=torch.long),
    )
    md._prefill_lens_list = prefill_lens
    md._prefill_context_list = prefill_contexts
    md._decode_max_len = max(context_lens, default=0)
    if type_ids:
        type_ids.extend([0] * (len(input_ids) - len(type_ids)))
        md.token_type_ids = long_tensor(type_ids)  # [T]
    return long_tensor(input_ids), long_tensor(positions), md


class ModelRunner:
    """Runs this stage's slice of the model for one step."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        block_size: int,
        device: torch.device,
        model_config: Any = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.layout = layout
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Grammars and matchers of structured outputs, on the sampling rank; built on the
        # first constrained request (see vllm/structured_output/matcher.py for why here).
        self._structured: StructuredOutputState | None = None
        # This stage's LoRA adapters (enable_lora; set by the worker), else None.
        self.lora_manager: StageLoRAManager | None = None
        # Last stage: the earlier chunks' hidden states of chunked pooling prompts.
        self.pooling_buffer = PoolingBuffer()

    def drop_requests(self, request_ids: list[str]) -> None:
        """Finished requests: forget their structured-output state and pooling chunks."""
        if self._structured is not None:
            self._structured.drop(request_ids)
        self.pooling_buffer.drop(request_ids)

    def _structured_state(self, metadata_list: list[SequenceGroupMetadata]) -> Any:
        """The structured-output state when this step has a constrained group (and this rank
        samples), with the grammars of new requests compiling in the background."""
        if ps.get_tensor_model_parallel_rank() != 0:
            return None
        if not any(m.sampling_params.structured_outputs is not None for m in metadata_list):
            return None
        if self._structured is None:
            if self.model_config is None:
                raise ValueError("structured outputs need the model config on the last stage")
            self._structured = StructuredOutputState(compile_cache_for(self.model_config))
        self._structured.prefetch(metadata_list)
        return self._structured

    @torch.inference_mode()
    def execute_stage(
        self,
        kv_caches: list[KVCache],
        rows: StepRows | None,
        received: dict[str, Any] | None,
        generators: dict[str, torch.Generator] | None = None,
    ) -> tuple[dict[str, Any] | None, SamplerOutput | None]:
        """Run this stage. Returns (what to send to the next stage, sampler output if last).

        The first stage builds inputs from `rows` (its `RequestTable`'s); later stages take
        the hidden states and metadata in `received` (from the previous stage). The last
        stage samples with the seeded `generators` (per request, kept by its table)."""
        structured = None
        if self.layout.is_last and rows is not None:
            structured = self._structured_state(rows.groups)
        hidden, to_send = self._forward(kv_caches, rows, received)
        if to_send is not None:
            return to_send, None
        assert rows is not None
        if any(meta.pooling_params is not None for meta in rows.groups):
            if ps.get_tensor_model_parallel_rank() != 0:
                return None, None  # the TP driver pools (every rank has the full rows)
            return None, self._pool(hidden, rows)
        sampling_md = build_sampling_metadata(
            rows.layout, rows.order, generators if generators is not None else {}, self.device
        )
        if sampling_md.num_rows == 0:
            # Only prefill chunks that end before their prompts do: nothing to sample. Only the
            # TP driver answers, as when there are rows: a non-driver rank that returned an
            # output would act as the driver and send the step's sampled ids itself.
            if ps.get_tensor_model_parallel_rank() != 0:
                return None, None
            return None, [SequenceGroupOutput([]) for _ in rows.groups]
        logits = self.model.compute_logits(
            hidden.index_select(0, sampling_md.selected_token_indices)
        )
        if logits is None:  # a TP rank other than the driver: the driver samples
            return None, None
        if structured is not None:
            logits = logits.float()  # [S, V]; the mask kernel takes fp32
            structured.apply(logits, sampling_md)
        output = self.sampler(logits, sampling_md)
        if sampling_md.verified is not None:
            output = accept_drafts(output, sampling_md.verified)
        return None, output

    def _pool(self, hidden: torch.Tensor, rows: StepRows) -> SamplerOutput:
        """The pooled outputs of a step of pooling requests (one per group, scheduler order):
        a chunk before the end of its prompt is kept (`PoolingBuffer`); the last one pools
        with the chunks kept. hidden: [T, H], the prefills' tokens in `rows.layout` order."""
        spans: dict[str, tuple[int, int, int]] = {}  # request id -> (offset, start, length)
        offset = 0
        for meta in rows.layout:
            if not meta.is_prompt or meta.pooling_params is None or len(meta.seq_data) != 1:
                raise RuntimeError(
                    f"request {meta.request_id}: a pooling step holds only pooling prompts"
                )
            data = next(iter(meta.seq_data.values()))
            length = meta.token_chunk_size or data.get_num_uncomputed_tokens()
            spans[meta.request_id] = (offset, data.get_num_computed_tokens(), length)
            offset += length
        config = self.model_config
        pooler = getattr(config, "pooler_config", None)
        pooling_type = getattr(pooler, "pooling_type", None) or "LAST"
        head = getattr(self.model, "classify_head", None)
        if not getattr(self.model, "has_classifier", head is not None):
            head = None
        pad_id = getattr(getattr(config, "hf_config", None), "pad_token_id", None)
        outputs: SamplerOutput = []
        for meta in rows.groups:
            offset, start, length = spans[meta.request_id]
            chunk = hidden[offset : offset + length]  # [n, H]
            if not meta.do_sample:  # an earlier chunk: kept until the last one arrives
                if pooling_type != "LAST":
                    self.pooling_buffer.add(meta.request_id, start, chunk)
                outputs.append(SequenceGroupOutput([]))
                continue
            first, joined = self.pooling_buffer.take(meta.request_id, start, chunk)
            data = next(iter(meta.seq_data.values()))
            try:
                pooled = pool(
                    joined,
                    first,
                    data.prompt_token_ids,
                    meta.pooling_params,
                    pooling_type,
                    head,
                    pad_id,
                )
            except PoolingStateLost as error:
                outputs.append(SequenceGroupOutput([], error=str(error), recompute=True))
                continue
            with torch.inference_mode(False):
                # A normal tensor of its own: a view would pickle the whole step's storage,
                # and an inference tensor refuses in-place use in the caller's code.
                pooled = pooled.to("cpu").clone()
            outputs.append(SequenceGroupOutput([], pooled=pooled))
        return outputs

    def _forward(
        self,
        kv_caches: list[KVCache],
        rows: StepRows | None,
        received: dict[str, Any] | None,
    ) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """This stage's layers: (hidden states [T, H], what to send on; None on the last
        stage). The first stage builds its inputs from `rows`, later ones take `received`."""
        lora_ids: torch.Tensor | None = None  # [T] each token's adapter (LoRA enabled)
        if self.layout.is_first:
            assert rows is not None
            input_ids, positions, md = prepare_inputs(rows.layout, self.block_size, self.device)
            if self.lora_manager is not None:
                lora_ids = token_lora_ids(rows.layout, md._prefill_lens_list or [], self.device)
                self.lora_manager.activate(lora_ids)
            if md.token_type_ids is not None:  # an encoder's pair input (score / rerank)
                hidden = self.model(
                    input_ids, positions, kv_caches, md, token_type_ids=md.token_type_ids
                )
            else:
                hidden = self.model(input_ids, positions, kv_caches, md)
        else:
            assert received is not None
            positions = received["positions"]
            md = InputMetadata.from_dict(received)
            if self.lora_manager is not None:
                # The first stage's mapping travels with the hidden states.
                lora_ids = received["lora_ids"]
                self.lora_manager.activate(lora_ids)
            hidden = self.model(None, positions, kv_caches, md, hidden_states=received["hidden"])
        if self.layout.is_last:
            return hidden, None
        to_send = {"hidden": hidden, "positions": positions, **md.to_dict()}
        if lora_ids is not None:
            to_send["lora_ids"] = lora_ids
        return hidden, to_send

    def replay_stage(
        self, kv_caches: list[KVCache], rows: StepRows, received: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """A replay step of a rebuilt stage: its layers on prefill chunks of committed tokens
        (their KV is written at their slots), nothing sampled. Returns what a next stage
        would get (None on the last stage)."""
        with torch.inference_mode():
            return self._forward(kv_caches, rows, received)[1]

    def replay_inputs(self, rows: StepRows) -> dict[str, Any]:
        """The positions, metadata (and LoRA mapping) of a replay step, without the hidden
        states: a kept stage sends them with its boundary rows to a rebuilt next stage."""
        _, positions, md = prepare_inputs(rows.layout, self.block_size, self.device)
        to_send: dict[str, Any] = {"positions": positions, **md.to_dict()}
        if self.lora_manager is not None:
            to_send["lora_ids"] = token_lora_ids(
                rows.layout, md._prefill_lens_list or [], self.device
            )
        return to_send
