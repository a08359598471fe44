"""Send/receive a dict of tensors and plain values between pipeline stages.

Wire format, all point-to-point over one group, in this order:
  1. int64 tensor [1]     - byte length of the pickled header
  2. uint8 tensor [n]     - pickled header: [(key, "t", shape, dtype) | (key, "v", value), ...]
  3. each non-empty tensor's data, in key order (0-element tensors are not sent)

Both backends match point-to-point messages FIFO per (src, dst, tag), so the receiver can rely
on this order even while several async sends are in flight.

On CUDA (NCCL) every transfer runs on a dedicated communication stream per device. Three
ordering rules keep that safe; the seed fork crashed with "CUDA error: an illegal memory
access" because one of them was missing:
  (a) the comm stream waits on the compute stream before sending;
  (b) a sent tensor stays alive until its send has completed;
  (c) the compute stream waits on the comm stream before a received tensor is used.

The header is unpickled: peers must be trusted (they are ranks of the same engine).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

_TENSOR = "t"
_VALUE = "v"

# One comm stream per CUDA device index, created lazily on first use.
_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}

# bfloat16 over gloo: on torch 2.13 gloo send/recv copy raw bytes whatever the dtype (bfloat16,
# float16, bool, float8, complex and uint16/32/64 are all accepted), so bfloat16 goes natively,
# without an int16 view. tests/test_communication.py checks it bit by bit, NaN payloads included.


class SendHandle:
    """Pending sends of one tensor dict; ``wait()`` completes them and frees the tensors.

    Always call ``wait()``: dropping an unwaited handle frees buffers a send may still read.
    """

    def __init__(
        self,
        works: list[Any],
        tensors: list[torch.Tensor],
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._works = works
        # Rule (b): holding the tensors keeps their memory from being freed (and reused by the
        # caching allocator) while a send may still read it.
        self._tensors = tensors
        self._stream = stream

    def wait(self) -> None:
        """Block until every send has completed (the peer has received), then release."""
        if self._stream is None:
            for work in self._works:
                work.wait()
        else:
            # NCCL's work.wait() only makes the *current* stream wait on the NCCL stream, so run
            # it on the comm stream, then block the host so "completed" means the same as on gloo.
            with torch.cuda.stream(self._stream):
                for work in self._works:
                    work.wait()
            self._stream.synchronize()
        self._works = []
        self._tensors = []

    def is_completed(self) -> bool:
        """True when every send has finished (non-blocking)."""
        return all(work.is_completed() for work in self._works)


def _uses_nccl(group: dist.ProcessGroup | None) -> bool:
    """True when point-to-point tensors must be CUDA tensors (NCCL backend)."""
    return "nccl" in str(dist.get_backend(group)).lower()


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The dedicated communication stream of ``device`` (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COMM_STREAMS.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _COMM_STREAMS[index] = stream
    return stream


def _check_plain(key: Any, value: Any) -> None:
    """Reject tensors hidden inside plain values: they would be pickled into the header."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"tensor_dict[{key!r}] nests a torch.Tensor inside a plain value")
    if isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _check_plain(key, item)
    elif isinstance(value, dict):
        for item in value.values():
            _check_plain(key, item)


def send_tensor_dict(
    tensor_dict: dict[str, Any],
    dst: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> SendHandle | None:
    """Send ``tensor_dict`` (tensors and picklable plain values) to global rank ``dst``.

    With ``async_op=False`` this returns once every send has completed. With ``async_op=True``
    it returns a ``SendHandle`` at once; call ``.wait()`` on it before relying on completion,
    and do not modify the sent tensors in place until then (the send may still read them).
    gloo sends complete only when the peer has posted the matching receive.
    """
    # Everything that can fail (bad values, unpicklable objects) fails here, before the first
    # byte goes out, so the receiver is never left with half a message.
    header: list[tuple[Any, ...]] = []
    tensors: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            header.append((key, _TENSOR, tuple(value.shape), value.dtype))
            if value.numel() > 0:
                tensors.append(value)
        else:
            _check_plain(key, value)
            header.append((key, _VALUE, value))
    header_bytes = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)

    if not _uses_nccl(group):
        # gloo moves CPU tensors only; .cpu() of a CUDA tensor synchronises, so it is safe.
        wire = [t.detach().cpu().contiguous() for t in tensors]
        length = torch.tensor([len(header_bytes)], dtype=torch.int64)  # [1]
        header_t = torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8)  # [n]
        # gloo isend starts the transfer at once; the pair delivers messages in call order.
        works = [dist.isend(t, dst, group=group) for t in (length, header_t, *wire)]
        handle = SendHandle(works, [length, header_t, *wire], stream=None)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        # contiguous()/to() may launch copy kernels on the compute stream; they must be queued
        # before rule (a) below so the comm stream also waits for them.
        wire = [t.detach().to(device).contiguous() for t in tensors]
        stream = _comm_stream(device)
        # Rule (a): the producer kernels of these tensors were queued on the compute stream and
        # may not have run yet; sending without this wait ships stale or half-written memory.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # NCCL cannot move CPU tensors, so the header travels as GPU tensors too. They are
            # allocated and filled on the comm stream, hence already ordered before the sends.
            length = torch.tensor([len(header_bytes)], dtype=torch.int64, device=device)  # [1]
            header_t = torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8).to(device)
            works = [dist.isend(t, dst, group=group) for t in (length, header_t, *wire)]
        for t in wire:
            # Rule (b): these blocks belong to the compute stream's pool; if the caller frees
            # them, the allocator must not hand them out again before the comm stream (which
            # waits on the NCCL sends in SendHandle.wait) is past this point.
            t.record_stream(stream)
        handle = SendHandle(works, [length, header_t, *wire], stream=stream)

    if async_op:
        return handle
    handle.wait()
    return None


def recv_tensor_dict(
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Receive a dict sent by ``send_tensor_dict`` from global rank ``src``.

    Keys come back in the sender's order. Tensors are contiguous and land on ``device``
    (default: the current CUDA device with NCCL, CPU with gloo).
    """
    nccl = _uses_nccl(group)
    wire_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    target = torch.device(device) if device is not None else wire_device
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())

    if not nccl:
        header = _recv_header(src, group, wire_device)
        result = _recv_payload(header, src, group, wire_device)
        received = [v for v in result.values() if isinstance(v, torch.Tensor)]
    else:
        stream = _comm_stream(wire_device)
        with torch.cuda.stream(stream):
            # Buffers are allocated on the comm stream, so the allocator already orders them
            # after any earlier use of the same memory by this stream.
            header = _recv_header(src, group, wire_device)
            result = _recv_payload(header, src, group, wire_device)
        compute = torch.cuda.current_stream(wire_device)
        # Rule (c): recv only queued the transfer; without this wait the compute stream could
        # read a received buffer before NCCL has written it.
        compute.wait_stream(stream)
        received = [v for v in result.values() if isinstance(v, torch.Tensor)]
        for t in received:
            if t.numel() == 0:
                continue  # no memory block behind it
            # Rule (c), lifetime half: the block belongs to the comm stream's pool; when the
            # caller frees it, reuse must wait for the compute stream's pending reads.
            t.record_stream(compute)

    if target != wire_device and received:
        result = {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in result.items()}
    return result


def _recv_header(src: int, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """Receive the length-prefixed pickled header."""
    length = torch.empty(1, dtype=torch.int64, device=device)  # [1]
    dist.recv(length, src, group=group)
    # .item() copies to the host on the current (comm) stream and waits for it.
    header_t = torch.empty(int(length.item()), dtype=torch.uint8, device=device)  # [n]
    dist.recv(header_t, src, group=group)
    return pickle.loads(header_t.cpu().numpy().tobytes())


def _recv_payload(
    header: list[Any], src: int, group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, Any]:
    """Allocate and receive every tensor announced in ``header``; fill in plain values."""
    result: dict[str, Any] = {}
    works = []
    for entry in header:
        key, kind = entry[0], entry[1]
        if kind == _VALUE:
            result[key] = entry[2]
            continue
        shape, dtype = entry[2], entry[3]
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel() > 0:
            # Posting every receive before waiting lets gloo overlap them (about 2x faster than
            # one blocking recv after another); matching stays FIFO, so order is preserved.
            works.append(dist.irecv(t, src, group=group))
        result[key] = t
    for work in works:
        # On NCCL this runs on the comm stream (see recv_tensor_dict): a stream-level wait.
        work.wait()
    return result
