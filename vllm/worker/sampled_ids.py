"""The channel of sampled token ids from the last stage to the first (asynchronous pipeline).

A decode scheduled ahead of its previous step's output feeds a token the engine has not seen
yet: the last stage sends the ids each step sampled straight to the first stage's ranks (and to
its own other TP ranks, whose sampler returns nothing), and the first stage takes them in step
order when a later step names them (`StepMessage.recv_sampled_through`, set by the engine's
`BatchQueue`). Both ends record the ids in their `RequestTable`.
"""

from __future__ import annotations

from vllm.config import ParallelConfig
from vllm.distributed.communication import recv_tensor_dict, release_when_sent, send_tensor_dict
from vllm.sequence import SamplerOutput
from vllm.step_records import StepMessage
from vllm.worker.request_table import RequestTable


class SampledIdChannel:
    """One rank's end of the channel; owns the number of the last step taken."""

    def __init__(self, rank: int, parallel_config: ParallelConfig) -> None:
        self.rank = rank
        self.parallel_config = parallel_config
        self.received_through = 0

    def reset(self) -> None:
        """New process groups start a new channel, numbered from 0 by the engine."""
        self.received_through = 0

    def receive(self, through: int, state: RequestTable) -> None:
        """First stage: take the sampled-id messages up to step `through` (the decodes
        scheduled ahead in this step feed those tokens)."""
        src = self.parallel_config.last_stage_driver_rank
        while self.received_through < through:
            message = recv_tensor_dict(src, device="cpu")
            if message["step_no"] != self.received_through + 1:
                raise RuntimeError(
                    f"rank {self.rank}: sampled ids of step {message['step_no']} arrived, "
                    f"step {self.received_through + 1} was expected"
                )
            state.record_sampled(message["pairs"])
            self.received_through = message["step_no"]

    def share(self, step: StepMessage, output: SamplerOutput | None, state: RequestTable) -> None:
        """Last stage: keep the ids this step sampled (for decodes scheduled ahead) and, with
        the asynchronous pipeline, send them to the first stage's ranks and this stage's other
        TP ranks (which take them here, from the driver)."""
        pc = self.parallel_config
        tp = pc.tensor_parallel_size
        driver = pc.last_stage_driver_rank
        if output is not None:
            pairs = [(s.parent_seq_id, s.output_token) for g in output for s in g.samples]
            state.record_sampled(pairs)
            if not step.send_sampled:
                return
            message = {"step_no": step.step_no, "pairs": pairs}
            for peer in [*range(tp), *range(driver + 1, driver + tp)]:
                # Nothing here may wait for these sends: the first stage takes the ids only
                # when a later step of the engine asks it to (see BatchQueue).
                release_when_sent(send_tensor_dict(message, peer, async_op=True))
        elif step.send_sampled and self.rank != driver:
            state.record_sampled(recv_tensor_dict(driver, device="cpu")["pairs"])
