"""The tool-call deltas of one streamed chat choice, in OpenAI's shape: a call's first delta
carries its index, id, type and name (and the arguments so far), later ones only more of its
`arguments`. Each step gives the calls read from the output so far; only what was not sent yet
goes out, so the pieces of a call add up to its whole arguments text."""

from __future__ import annotations

from vllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, ToolCall


class ToolCallStreamer:
    """What one choice has sent of its calls (their ids and arguments so far)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[str] = []  # each call's arguments text already sent

    @property
    def started(self) -> bool:
        return bool(self.ids)

    def deltas(self, calls: list[tuple[str | None, str]]) -> list[DeltaToolCall]:
        """The new pieces of `calls` ((name or None while unknown, arguments so far) each, in
        order); a call is announced once its name is known, after every call before it."""
        out: list[DeltaToolCall] = []
        for index, (name, arguments) in enumerate(calls):
            if name is None:
                break
            if index == len(self.ids):
                self.ids.append(ToolCall.new_id())
                self.sent.append(arguments)
                out.append(
                    DeltaToolCall(
                        index=index,
                        id=self.ids[index],
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=arguments),
                    )
                )
                continue
            sent = self.sent[index]
            # A later reading that does not extend what was sent (it cannot be taken back)
            # adds nothing.
            if len(arguments) > len(sent) and arguments.startswith(sent):
                self.sent[index] = arguments
                out.append(
                    DeltaToolCall(
                        index=index, function=DeltaFunctionCall(arguments=arguments[len(sent) :])
                    )
                )
        return out

    def finish(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """The last pieces, from the whole output's calls."""
        return self.deltas([(call.function.name, call.function.arguments) for call in calls])
