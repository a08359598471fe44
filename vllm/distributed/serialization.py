"""What crosses to a stage process, pickled: a step, a call, a result (torch-free).

Plain pickle first, cloudpickle for what it refuses (a user's logits processor defined inside
a function), as Ray would send it; a message neither can serialise is refused before any byte
of it is sent.
"""

from __future__ import annotations

import pickle


class MessageNotSerializableError(TypeError):
    """Neither pickle nor cloudpickle can serialise a message for a stage. Raised before any
    byte of the step is sent (`RankCalls.submit` serialises every rank's part first), so the
    stages never see a half-sent step."""


def dumps_message(message: object) -> bytes:
    """Pickle what crosses to a stage (a step, a call, a result).

    Plain pickle first (the fastest); what it refuses -- a user's logits processor defined
    inside a function -- goes through cloudpickle, as Ray would send it (plain `pickle.loads`
    reads both). MessageNotSerializableError when neither can."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    import cloudpickle

    try:
        return cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # cloudpickle raises whatever the object's reduction raises
        raise MessageNotSerializableError(
            f"cannot be serialised for the pipeline stages: {type(exc).__name__}: {exc}"
        ) from exc


def message_bytes(message: object) -> int:
    """The pickled size of a step message, as a measure of what crosses to a stage."""
    return len(dumps_message(message))
