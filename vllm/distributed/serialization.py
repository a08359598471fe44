"""What crosses between the engine and a stage process, pickled, and what may be read back
(torch-free).

Writing (`dumps_message`): plain pickle for the message types, with two exceptions made
explicit in the bytes. A tensor goes as (dtype, shape, raw bytes), rebuilt by
`rebuild_tensor` (torch's own reduction would call `torch.load`, a full unpickler). A
function, method, or an instance of a class outside the message types (a user's logits
processor, a closure or lambda above all) goes as one opaque cloudpickle blob, rebuilt by
`load_user_code`, as Ray would send it; a message that cannot be serialised is refused before
any byte of it is sent.

Reading is restricted to the message types (`loads_message`): `pickle.Unpickler.find_class`
resolves only the classes of the modules in `MESSAGE_MODULES`, a few containers, torch's
dtypes and devices, `transformers` model configs (inside the engine config) and
`rebuild_tensor`; anything else -- `os.system`, `builtins.eval`, `torch.load` -- raises
RefusedGlobalError naming it. User code is the one door: `load_user_code` resolves only where
the reader accepts it, i.e. at a rank reading its engine's calls (`allow_user_code=True`):
the engine sends its users' logits processors by design, and the connection is the engine's
own (`rank_handshake`: every message authenticated). The engine reading its ranks' replies
accepts no code at all: a compromised rank cannot run code in the engine through a reply.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

# Modules whose classes (never their functions) make up the messages: steps and replays,
# the engine config, LoRA requests, the sampling parameters, the results and reports.
MESSAGE_MODULES = frozenset(
    {
        "vllm.config",
        "vllm.step_records",
        "vllm.sequence",
        "vllm.sampling_params",
        "vllm.structured_output.params",
        "vllm.lora.request",
        "vllm.lora.peft_config",
        "vllm.outputs",
        "vllm.request_failure",
        "vllm.worker.stage_report",
        "vllm.model_executor.models.utils",
        "vllm.distributed.rank_verbs",
    }
)

# Other globals a message may name: containers, and torch's dtypes and devices (by name).
_TORCH_DTYPES = frozenset(
    {
        "float16", "float32", "float64", "bfloat16", "half", "float", "double",
        "int8", "int16", "int32", "int64", "uint8", "bool", "long", "int",
        "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
    }
)  # fmt: skip
SAFE_GLOBALS = frozenset(
    {
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        ("builtins", "range"),
        ("builtins", "bytearray"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("torch", "device"),
        ("torch", "dtype"),
        ("torch", "Size"),
        (__name__, "rebuild_tensor"),
    }
    | {("torch", name) for name in _TORCH_DTYPES}
)
_USER_CODE = (__name__, "load_user_code")


class MessageNotSerializableError(TypeError):
    """Neither pickle nor cloudpickle can serialise a message for a stage. Raised before any
    byte of the step is sent (`RankCalls.submit` serialises every rank's part first), so the
    stages never see a half-sent step."""


class RefusedGlobalError(pickle.UnpicklingError):
    """A message named a class or function outside the message types (`loads_message`)."""


def _is_transformers_config(cls: type) -> bool:
    """A `transformers` model config class (the engine config holds the model's)."""
    return cls.__module__.startswith("transformers.") and any(
        base.__name__ == "PretrainedConfig" and base.__module__.startswith("transformers.")
        for base in cls.__mro__
    )


@functools.lru_cache(maxsize=1024)
def _is_message_type(cls: type) -> bool:
    """May an instance of `cls` (or `cls` itself) cross as a plain pickle?"""
    module, name = cls.__module__, cls.__qualname__
    if (module, name) in SAFE_GLOBALS:
        return True
    if module in MESSAGE_MODULES:
        return "<locals>" not in name
    return _is_transformers_config(cls)


def _tensor_reduction(tensor: Any) -> tuple[Any, tuple]:
    """A tensor as (dtype name, shape, raw bytes), on the CPU."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return rebuild_tensor, (str(flat.dtype).removeprefix("torch."), tuple(tensor.shape), data)


def rebuild_tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> Any:
    """The reader's end of `_tensor_reduction`."""
    import torch

    if not isinstance(dtype, str) or dtype not in _TORCH_DTYPES:
        raise RefusedGlobalError(f"a tensor of dtype {dtype!r} is not a message type")
    torch_dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).reshape(shape)


def load_user_code(blob: bytes) -> Any:
    """A user's function or object (a logits processor), sent by the engine as cloudpickle
    bytes. Only a rank reading its engine's calls resolves this (`loads_message`)."""
    return pickle.loads(blob)


class _MessagePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # Called for every object but None, bools and exact ints, floats, str, bytes and the
        # builtin containers: those are message data whatever holds them.
        if obj is load_user_code or obj is rebuild_tensor:
            return NotImplemented  # the two rebuilders, named by reference
        cls = obj if isinstance(obj, type) else type(obj)
        if cls.__module__ == "torch" and cls.__name__ == "Tensor" and cls is type(obj):
            return _tensor_reduction(obj)
        if cls.__module__ == "torch.nn.parameter" and cls is type(obj):
            return _tensor_reduction(obj)
        if _is_message_type(cls):
            return NotImplemented
        return load_user_code, (_cloudpickle(obj),)


def _cloudpickle(obj: Any) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # cloudpickle raises whatever the object's reduction raises
        raise MessageNotSerializableError(
            f"cannot be serialised for the pipeline stages: {type(exc).__name__}: {exc}"
        ) from exc


def dumps_message(message: object) -> bytes:
    """Pickle what crosses to or from a stage (a step, a call, a result): see the module's
    docstring. MessageNotSerializableError when some part cannot be serialised."""
    buf = io.BytesIO()
    try:
        _MessagePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    except MessageNotSerializableError:
        raise
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise MessageNotSerializableError(
            f"cannot be serialised for the pipeline stages: {type(exc).__name__}: {exc}"
        ) from exc
    return buf.getvalue()


class _MessageUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes | memoryview, allow_user_code: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._allow_user_code = allow_user_code

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _USER_CODE:
            if self._allow_user_code:
                return load_user_code
            raise RefusedGlobalError(
                "refused to unpickle user code (a function or a non-message object) in a "
                "rank's reply: only the engine's calls to a rank may carry it"
            )
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in MESSAGE_MODULES or module.startswith("transformers."):
            try:
                found = super().find_class(module, name)
            except AttributeError as exc:
                # A type the reader's version no longer has (or never had): a writer of
                # another version, say, whose message this end cannot read.
                raise RefusedGlobalError(
                    f"refused to unpickle {module}.{name}: {module} has no such message type "
                    "(written by another version of vllm?)"
                ) from exc
            if isinstance(found, type) and _is_message_type(found):
                return found
        raise RefusedGlobalError(
            f"refused to unpickle {module}.{name}: not a message type (a message holds only "
            f"classes of {', '.join(sorted(MESSAGE_MODULES))}, containers, tensors and "
            "transformers model configs)"
        )


def loads_message(data: bytes | memoryview, allow_user_code: bool = False) -> Any:
    """Read a message written by `dumps_message`, resolving only the message types (see the
    module's docstring); RefusedGlobalError naming anything else. `allow_user_code`: only
    for a rank reading its engine's calls."""
    return _MessageUnpickler(data, allow_user_code).load()


def message_bytes(message: object) -> int:
    """The pickled size of a step message, as a measure of what crosses to a stage."""
    return len(dumps_message(message))
